{{/* Names and labels. */}}
{{- define "chattts-triton.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "chattts-triton.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "chattts-triton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chattts-triton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "chattts-triton.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "chattts-triton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "chattts-triton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "chattts-triton.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* GPU ids as the container sees them (the device plugin numbers a pod's GPUs from 0): "0,1,...". */}}
{{- define "chattts-triton.gpuIds" -}}
{{- $ids := list }}
{{- range $i := until (int .Values.gpu.count) }}
{{- $ids = append $ids (toString $i) }}
{{- end }}
{{- join "," $ids }}
{{- end }}

{{/* SIGTERM -> the launcher waits up to exitTimeoutSeconds for in-flight requests, then Triton drains up to
exitTimeoutSeconds more; the kubelet must not SIGKILL before that. */}}
{{- define "chattts-triton.terminationGracePeriodSeconds" -}}
{{- add (mul 2 (int .Values.server.exitTimeoutSeconds)) (int .Values.server.terminationMarginSeconds) }}
{{- end }}

{{/* The repository tritonserver serves. */}}
{{- define "chattts-triton.servedRepository" -}}
{{- if .Values.configure.enabled }}
{{- .Values.configure.workPath }}
{{- else }}
{{- .Values.modelRepository.mountPath }}
{{- end }}
{{- end }}

{{/*
prometheus-adapter rule: per pod (rules) or per namespace (externalRules), the time requests of the
composing models spent queued over the time they spent computing, as in NVIDIA's Triton autoscaling guide
(nv_inference_queue_duration_us / nv_inference_compute_infer_duration_us).
*/}}
{{- define "chattts-triton.adapterRule" -}}
{{- $a := .Values.prometheusAdapter -}}
{{- $m := $a.models -}}
{{- $w := $a.rateWindow -}}
- seriesQuery: '{{ $a.queueMetric }}{namespace!="",pod!=""}'
  resources:
    overrides:
      namespace: {resource: namespace}
{{- if eq .Values.autoscaling.metric.type "Pods" }}
      pod: {resource: pod}
{{- end }}
  name:
    matches: "^{{ $a.queueMetric }}$"
    as: {{ .Values.autoscaling.metric.name | quote }}
  metricsQuery: >-
    sum by (<<.GroupBy>>) (rate({{ $a.queueMetric }}{<<.LabelMatchers>>,model=~"{{ $m }}"}[{{ $w }}]))
    / clamp_min(sum by (<<.GroupBy>>) (rate({{ $a.computeMetric }}{<<.LabelMatchers>>,model=~"{{ $m }}"}[{{ $w }}])), 1)
{{- end }}

{{- define "chattts-triton.adapterRulesKey" -}}
{{- if eq .Values.autoscaling.metric.type "Pods" }}rules{{ else }}externalRules{{ end }}
{{- end }}

{{/* Mount of the exported repository (PVC) into a container; nothing when it is baked into the image. */}}
{{- define "chattts-triton.repositoryMount" -}}
{{- if eq .Values.modelRepository.source "pvc" -}}
- name: model-repository
  mountPath: {{ .Values.modelRepository.mountPath | quote }}
  readOnly: true
  {{- with .Values.modelRepository.pvc.subPath }}
  subPath: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}

{{/* CHATTTS_VOICE_STORE for Triton's models and the gateway: voiceStore's Secret, else its URL, else nothing (the
repository's voices.json). */}}
{{- define "chattts-triton.voiceStoreEnv" -}}
{{- if .Values.voiceStore.urlSecret }}
- name: CHATTTS_VOICE_STORE
  valueFrom:
    secretKeyRef:
      name: {{ .Values.voiceStore.urlSecret }}
      key: url
{{- else if .Values.voiceStore.url }}
- name: CHATTTS_VOICE_STORE
  value: {{ .Values.voiceStore.url | quote }}
{{- end }}
{{- end }}
