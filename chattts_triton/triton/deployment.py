"""The deployment: every setting of a served repository, each one field that carries its default, help, type, bounds
and flag, and nothing else holds them.

A field's name is its flag (`gpt_slots` is `--gpt-slots`), its key in the manifest's "deployment", and the parameter
name the python models read (params.py): one name from the config to the flag to the code. The commands that take
settings build their flags from the fields (`add_flags`): `python -m chattts_triton.repo_config` (`make configure`),
`python -m export` and `python -m bench.run`; `tests/test_deployment.py` checks that each has a flag of every field,
of the field's name, with the field's default. Adding a setting is adding a field here (and, where a model reads it,
the field of the same name in params.py).

The engines' admission defaults (`ADMIT_BATCH`, `ADMIT_WAIT_STEPS`) are config.py's: the engine below this wing
(runtime/) defaults to them too, and the fields name them rather than repeat them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, get_type_hints

from ..config import ADMIT_BATCH, ADMIT_WAIT_STEPS, KV_CACHE_DTYPES, PENDING_PER_SLOT, PRECISIONS, Arch
from ..memory import CPU_SLOTS, GPU_MEMORY_UTILIZATION, MAX_SLOTS
from ..model.chunks import stream_schedule

AUTO = "auto"  # a setting sized when the model loads (from the GPU's memory): the field's None
ARTIFACT_FORMATS = ("torchscript", "onnx")
OLD_DEFAULT_QUEUE_SIZE = 256  # every queue's bound in repositories written before the paged cache
CONFIGURE, EXPORT = "configure", "export"  # the commands that take settings: rewrite a repository, or write one
FIELD = "field's"  # a flag's default that is its field's


@dataclass(frozen=True)
class Setting:
    """What a `Deployment` field's flag needs beyond the field's name, type and default."""

    help: str
    auto: bool = False  # None is a value, written `auto` on the command line (sized at load, or worked out)
    min: float | None = None  # bounds, checked on the command line and by `Deployment.check`
    max: float | None = None
    above: float | None = None  # a bound the value must exceed
    choices: tuple = ()
    export_only: bool = False  # fixed by the exported artifacts: export sets it, configure cannot
    reset: bool = False  # configure sets it every time (omitted: the default) instead of keeping the repository's
    flag_default: Any = FIELD  # the flag's default where it is not the field's (a value export resolves)

    def bounds_error(self, name: str, value: Any) -> str | None:
        """Why `value` is out of this setting's bounds, or None."""
        if value is None or isinstance(value, (bool, str, list)):
            return None
        if self.min is not None and self.max is not None and not self.min <= value <= self.max:
            return f"{name} must be in [{_num(self.min)}, {_num(self.max)}], got {value}"
        if self.min is not None and value < self.min:
            return f"{name} must be ≥ {_num(self.min)}, got {value}"
        if self.above is not None and not value > self.above:
            return f"{name} must be > {_num(self.above)}, got {value}"
        return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, **meta: Any) -> Any:
    """A `Deployment` field: its default and its `Setting`."""
    return field(default=default, default_factory=default_factory, metadata={"setting": Setting(**meta)})


@dataclass
class Deployment:
    """Where instances run and how many, how the queues and engines are bounded, how streams are chunked, and which
    of the served paths' optional accelerations are on. The default of each field is the default of every command."""

    gpus: list[int] = setting(default_factory=list, reset=True,
                              help="comma-separated GPU ids of the instance groups; empty: the CPU (KIND_CPU)")
    instances: int = setting(1, min=1, reset=True,
                             help="instances per GPU (or on the CPU) of the batching python models")
    max_batch_size: int = setting(64, min=1, help="Triton max_batch_size of every batching model")
    max_queue_size: int | None = setting(
        None, auto=True, min=1,
        help="every Triton queue's bound (auto: twice what the engines admit, so that no queue refuses a request the "
             "engine would take: the only overload answer is the engine's \"server busy\")")
    queue_timeout_us: int = setting(0, min=0, help="how long a request may wait in a Triton queue, µs (0: no timeout)")
    max_queue_delay_us: int = setting(
        0, min=0,
        help="how long chattts_vocoder waits to form a batch, µs (0: it batches what queued while it worked; a delay "
             "only added latency at low load without raising throughput at high, docs/performance.md). The other "
             "models never wait: the GPT and stream models batch in their engines, the preprocess model prepares "
             "each request on its own")
    gpt_slots: int | None = setting(
        None, auto=True, min=1,
        help=f"engine slots per GPT instance (auto: on a GPU from its memory, {CPU_SLOTS['gpt']} on the CPU)")
    gpt_cache_tokens: int | None = setting(
        None, auto=True, min=1,
        help="positions of each GPT engine's paged KV cache, all requests together (auto: on a GPU from its memory, "
             "on the CPU slots × context)")
    gpt_context: int = setting(3072, min=1, help="prompt + generated positions of one request")
    gpt_max_pending: int | None = setting(
        None, auto=True, min=0,
        help=f"generations running + waiting per GPT engine before UNAVAILABLE (auto: {PENDING_PER_SLOT['gpt']} × "
             "slots; 0: no bound)")
    gpu_memory_gb: float | None = setting(
        None, auto=True, above=0,
        help="GPU memory the models plan with, GiB (auto: the card's; less to share a card or to size for a smaller "
             f"one; they plan within {int(GPU_MEMORY_UTILIZATION * 100)} % of it; memory.py)")
    gpt_admit_batch: int = setting(
        ADMIT_BATCH, min=1, help="while generating, an engine prefills waiting requests together once this many wait")
    gpt_admit_wait_steps: int = setting(
        ADMIT_WAIT_STEPS, min=0, help="... or once the oldest has waited this many decode steps")
    gil_switch_interval_us: int = setting(
        200, min=0, max=1_000_000,
        help="the interpreter's switch interval in the processes hosting an engine (GPT, stream), µs (0: Python's "
             "5000). The engine thread lets the GIL go at every torch call, graph replay and host sync; while "
             "Triton's request and reply threads want it, taking it back can wait the whole interval each time")
    dtype: str = setting(
        "fp32", choices=(AUTO, *PRECISIONS), export_only=True, flag_default=AUTO,
        help="precision of the engine and the codec (auto: fp32 on the CPU; on GPUs bf16 where every one listed "
             "supports it and no ONNX artifact is asked for, else fp16; int8: dynamic int8 GPT linears, CPU only)")
    artifact_format: str = setting(
        "torchscript", choices=ARTIFACT_FORMATS, export_only=True,
        help="what the decoder, DVAE and vocoder models load (onnx: export with --formats torchscript,onnx)")
    stream_slots: int | None = setting(
        None, auto=True, min=1, help="engine slots of each chattts_stream instance (auto: as --gpt-slots)")
    stream_cache_tokens: int | None = setting(
        None, auto=True, min=1,
        help="positions of each chattts_stream engine's KV cache (auto: on a GPU from its memory, on the CPU slots × "
             "context)")
    stream_max_pending: int | None = setting(
        None, auto=True, min=0,
        help=f"streams in flight per chattts_stream instance before UNAVAILABLE (auto: {PENDING_PER_SLOT['stream']} × "
             "slots; 0: no bound)")
    stream_first_chunk_frames: int = setting(8, help="code frames (21.3 ms of audio each) in a stream's first chunk")
    stream_chunk_frames: int = setting(32, help="code frames in each later chunk (more when generation runs ahead)")
    stream_lookahead_frames: int = setting(
        0, help="context frames each side of a chunk (0: exact, codec.stream_lookahead_codes)")
    stream_first_lookahead_frames: int = setting(
        8, help="right context of a stream's first chunk (0: as the later chunks)")
    stream_fade_frames: int = setting(4, help="frames cross-faded at each chunk seam (0: a hard cut; model/chunks.py)")
    gpt_compile: bool = setting(
        True,
        help="GPU instances run the decode step through torch.compile, faster than the TorchScript step "
             "(docs/performance.md); each GPU instance compiles for minutes at start-up. CPU instances run the "
             "TorchScript step")
    gpt_compile_prefill: bool = setting(
        False, help="with --gpt-compile: the prefills through torch.compile too (faster alone, but start-up grew "
                    "longer than the gain was worth: opt-in)")
    gpt_packed_prefill: bool = setting(
        True,
        help="with --gpt-compile: GPU engines prefill an admission's prompts packed end to end, each position a row "
             "of the decode kernel, instead of padded to the longest prompt (docs/engine.md)")
    gpt_gemv: bool = setting(
        True,
        help="with --gpt-compile: a decode step of one row (concurrency 1, a lone stream) computes its projections "
             "without cuBLAS GEMMs, whose time for one row is their launch: on GPUs with programmatic dependent "
             "launch (Hopper) as one Triton kernel per product fused with its norm, gate or skip connection, "
             "elsewhere as reductions inductor generates; its code heads as inductor's reductions (about a fifth off "
             "the step on an H100; steps of more rows unchanged; docs/performance.md)")
    gpt_gemv_tune: bool = setting(
        False,
        help="with --gpt-gemv: inductor tunes the launch configuration of the one-row step's kernels at the "
             "warm-up by coordinate descent (kernels that write the KV cache or other large state in place keep its "
             "heuristic's) and keeps its choices in its compile cache: about 5 % off a one-row step alone, not yet "
             "shown served, at the price of a longer start without that cache (docs/performance.md)")
    kv_cache_dtype: str = setting(
        "auto", choices=tuple(KV_CACHE_DTYPES),
        help="what the GPT and stream engines hold their keys and values in: auto, the engine's precision; fp8, "
             "float8 e4m3 (saturated, no scale): half the bytes a decode step's attention reads and half the cache's "
             "memory, at e4m3's precision (3 mantissa bits; its effect on real voices unmeasured: opt-in). "
             "+13 % at 1024 in flight on one H100, the GPU's memory 44 → 27 GB. GPUs of compute capability 8.9 or "
             "later with --gpt-compile (docs/performance.md)")
    gpt_overlap: bool = setting(
        True,
        help="GPU engines launch each decode step before reading the previous one's EOS flags back, so that the "
             "host's bookkeeping overlaps the GPU's step (CPU engines never: their ops are synchronous)")
    vocoder_graphs: bool = setting(
        True,
        help="GPU chattts_vocoder instances replay the decoder and Vocos from CUDA graphs, one launch per call "
             "instead of hundreds (groups of up to 16 utterances of up to 512 frames, longer ones eagerly)")
    stream_codec_stream: bool = setting(
        False,
        help="GPU chattts_stream instances decode on a CUDA stream of their own, so that the codec's calls overlap "
             "the engine's steps (no gain measured: opt-in)")
    stream_engine_priority: bool = setting(
        False,
        help="GPU chattts_stream engines launch their steps on a CUDA stream of the highest priority, so that the "
             "codec's kernels in the same process give the SMs to a step first instead of holding it for a whole "
             "codec call (no gain measured at 64 streams: opt-in; docs/streaming.md)")
    codec_compile: bool = setting(
        False,
        help="GPU chattts_vocoder (with --vocoder-graphs) and chattts_stream instances replay the decoder, DVAE and "
             "Vocos networks through torch.compile in their CUDA graphs: the elementwise chains, norms and depthwise "
             "convolutions fused; compiled at start-up. Faster alone at large batch but slower served on an H100 "
             "(mixed lengths, small stream windows): opt-in; docs/performance.md")
    stream_first_chunks_first: bool = setting(
        False,
        help="chattts_stream decodes new streams' first chunks in a codec call of their own, ahead of the running "
             "streams' chunks (one more codec call per step that starts a stream; its tail latency was worse: "
             "opt-in)")

    voice_store: str = setting(
        "",
        help="where the named voices are kept, one URL every replica and gateway shares: empty: the repository's "
             "voices.json; sqlite:///PATH; redis://HOST:PORT/DB; postgresql://USER@HOST/DB (env CHATTTS_VOICE_STORE, "
             "where set, in its place; docs/voices.md)")

    @classmethod
    def from_manifest(cls, man: dict) -> Deployment:
        """The deployment a repository was exported or configured with; one exported before the early
        first chunk keeps its exact chunks, one exported before the compiled step its TorchScript step, one
        exported before the vocoder's graphs its eager vocoder, one exported before the one-row reductions its
        GEMMs, one exported before their tuning its heuristic launch configurations. One written before the paged
        cache had every queue at 256 by default (a burst was refused below the engine's bound): that default becomes
        the engines' bound."""
        dep = dict(man["deployment"])
        if "gpt_cache_tokens" not in dep and dep.get("max_queue_size") == OLD_DEFAULT_QUEUE_SIZE:
            dep["max_queue_size"] = None
        return cls(**{"stream_first_lookahead_frames": 0, "stream_fade_frames": 0, "gpt_compile": False,
                      "vocoder_graphs": False, "gpt_gemv": False,
                      "gpt_gemv_tune": False, **dep})

    def check(self) -> None:
        """ValueError naming the first field out of its bounds."""
        for f in fields(self):
            why = spec(f).bounds_error(f.name, getattr(self, f.name))
            if why:
                raise ValueError(why)
        if self.kv_cache_dtype != "auto" and not (self.gpus and self.gpt_compile):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs GPUs (--gpus) and --gpt-compile: the CPU "
                             "engines and the TorchScript step hold the cache in the engine's precision")

    def stream_schedule(self, arch: Arch) -> dict[str, int]:
        """`chattts_stream`'s ChunkPlanner arguments (ValueError if refused)."""
        return stream_schedule(arch, self.stream_first_chunk_frames, self.stream_chunk_frames,
                               self.stream_lookahead_frames, self.stream_first_lookahead_frames,
                               self.stream_fade_frames)

    @property
    def kind(self) -> str:
        return "KIND_GPU" if self.gpus else "KIND_CPU"

    def slots(self, role: str = "gpt") -> int | None:
        """An engine's slots (role "gpt" or "stream"); None: sized from the GPU's memory when it loads."""
        n = self.gpt_slots if role == "gpt" else self.stream_slots
        if n is not None or self.gpus:
            return n
        return CPU_SLOTS[role]

    def cache_tokens(self, role: str = "gpt") -> int | None:
        """Positions of an engine's KV cache; None: on a GPU from its memory, on the CPU slots × context."""
        return self.gpt_cache_tokens if role == "gpt" else self.stream_cache_tokens

    def max_pending(self, role: str = "gpt") -> int | None:
        """An engine's admission bound (running + waiting; 0: none); None: PENDING_PER_SLOT × the slots it sizes."""
        n = self.gpt_max_pending if role == "gpt" else self.stream_max_pending
        if n is not None:
            return n
        slots = self.slots(role)
        return None if slots is None else PENDING_PER_SLOT[role] * slots

    def admission_bound(self, role: str = "gpt") -> int:
        """The most requests the engines of a role (one per GPU) admit together, at any size they may take."""
        n = self.max_pending(role)
        if not n:  # sized at load, or unbounded: as if at the largest batch
            n = PENDING_PER_SLOT[role] * (self.slots(role) or MAX_SLOTS[role])
        return n * max(1, len(self.gpus))

    def queue_size(self, role: str = "gpt") -> int:
        """The Triton queue bound of the models a role's requests pass through."""
        return self.max_queue_size if self.max_queue_size is not None else 2 * self.admission_bound(role)


# --- the flags -------------------------------------------------------------------------------------------------
def spec(f: dataclasses.Field) -> Setting:
    return f.metadata["setting"]


def setting_of(name: str) -> Setting:
    """The `Setting` of the field `name`."""
    return spec(Deployment.__dataclass_fields__[name])


def flag(name: str) -> str:
    """A field's flag: its name, dashed (`gpt_slots`: `--gpt-slots`)."""
    return "--" + name.replace("_", "-")


def default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh one where it is a factory's)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def flag_default(f: dataclasses.Field) -> Any:
    """The default of a field's flag where export or bench.run writes a repository: the field's, or the value
    the field names for its flag (`--dtype auto`, resolved by export)."""
    s = spec(f)
    return default(f) if s.flag_default == FIELD else s.flag_default


def settings(command: str = EXPORT) -> list[dataclasses.Field]:
    """The fields `command` takes: configure all but those the artifacts fix, export (and bench.run) all."""
    return [f for f in fields(Deployment) if command == EXPORT or not spec(f).export_only]


def _shown(value: Any) -> str:
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "empty"
    return str(value)


def _parser(name: str, kind: Any, s: Setting):
    """The argparse `type` of a field: its type, `auto` for None where it takes it, and its bounds."""
    if kind == list[int]:
        def parse(text: str) -> list[int]:
            try:
                return [int(g) for g in text.split(",") if g.strip() != ""]
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU ids") from None
        return parse
    number = float if kind in (float, float | None) else int if kind in (int, int | None) else str

    def parse(text: str) -> Any:
        if s.auto and text == AUTO:
            return AUTO
        try:
            value = number(text)
        except ValueError:
            what = "a whole number" if number is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}{' (or auto)' if s.auto else ''}") from None
        why = s.bounds_error(name, value)
        if why:
            raise argparse.ArgumentTypeError(why)
        return value

    parse.__name__ = number.__name__
    return parse


def add_flags(ap: argparse.ArgumentParser, command: str = EXPORT, defaults: Mapping[str, Any] = (),
              title: str = "deployment settings (chattts_triton/triton/deployment.py)") -> None:
    """One flag per field `command` takes, of the field's name, type, bounds and help.

    EXPORT (export, bench.run): each flag's default is the field's (`flag_default`), or `defaults`' where a command
    names its own (bench.run serves on GPU 0). CONFIGURE: an omitted flag keeps the repository's value (default
    None), except the fields that `reset`, whose default is the field's."""
    defaults = dict(defaults)
    kinds = get_type_hints(Deployment)
    group = ap.add_argument_group(title)
    for f in settings(command):
        s = spec(f)
        keep = command == CONFIGURE and not s.reset
        value = defaults.get(f.name, flag_default(f))
        if keep:
            note = f"default of a new export: {_shown(default(f))}; omitted: the repository's kept"
        else:
            note = f"default: {_shown(value)}"
        text = f"{s.help} ({note})".replace("%", "%%")
        if kinds[f.name] is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None if keep else value,
                               help=text)
            continue
        kind = kinds[f.name]
        metavar = None if s.choices else "IDS" if kind == list[int] else "N" if kind in (int, int | None) else "X"
        group.add_argument(flag(f.name), type=_parser(f.name, kind, s), default=None if keep else value,
                           choices=s.choices or None, metavar=metavar and metavar + ("|auto" if s.auto else ""),
                           help=text)


def from_args(args: argparse.Namespace, base: Deployment | None = None, command: str = EXPORT,
              **given: Any) -> Deployment:
    """The deployment the flags of `add_flags` say: `base` (default: the fields' defaults) with each flag given
    (`auto`: None; CONFIGURE: an omitted flag keeps `base`'s), and `given` over them."""
    dep = dataclasses.replace(base) if base is not None else Deployment()
    for f in settings(command):
        value = getattr(args, f.name)
        if value is not None:
            setattr(dep, f.name, None if value == AUTO and spec(f).auto else value)
    for name, value in given.items():
        setattr(dep, name, value)
    return dep


def settings_table() -> str:
    """The settings as docs/deployment.md lists them (a test keeps the two equal): flag, default, help."""
    rows = ["| flag | default | configure | what it sets |", "|---|---|---|---|"]
    for f in fields(Deployment):
        s = spec(f)
        shown = _shown(flag_default(f)) + (f" (resolved at export, `{_shown(default(f))}` in the field)"
                                           if s.flag_default != FIELD else "")
        configure = "no: export's" if s.export_only else "set each time" if s.reset else "kept unless given"
        rows.append(f"| `{flag(f.name)}` | {shown} | {configure} | "
                    f"{s.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
