"""Type a line, hear it while it is spoken; '/stop' interrupts (barge-in). Raw 24 kHz PCM goes to stdout:

    python docs/examples/realtime_client.py | ffplay -nodisp -f s16le -ar 24000 -ch_layout mono -
"""
import asyncio
import json
import sys

import websockets

URL = sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080/v1/audio/speech/stream"


async def play(ws, done: asyncio.Event):
    async for msg in ws:
        if isinstance(msg, bytes):  # audio, in order, as it is made
            sys.stdout.buffer.write(msg)
            sys.stdout.buffer.flush()
            continue
        event = json.loads(msg)
        if event["type"] == "segment.end":  # what was said, and where it lies in the audio
            print(f"{event['start']:6.2f}–{event['end']:.2f} s  {event['text']}", file=sys.stderr)
        elif event["type"] == "error":
            print("error:", event["error"]["message"], file=sys.stderr)
        elif event["type"] in ("turn.done", "turn.cancelled"):
            done.set()


async def main():
    async with websockets.connect(URL) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"voice": "nova"}}))
        done = asyncio.Event()
        player = asyncio.create_task(play(ws, done))
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "/stop":
                await ws.send(json.dumps({"type": "cancel"}))
                continue
            for word in line.split(" "):  # as an LLM would send it: a word at a time
                await ws.send(json.dumps({"type": "text", "text": word + " "}))
        done.clear()
        await ws.send(json.dumps({"type": "flush"}))  # end of input: speak the rest, then close
        await done.wait()
        player.cancel()


asyncio.run(main())
