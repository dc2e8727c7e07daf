{{/* Names and labels. */}}
{{- define "pagoda.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.name" -}}{{ include "pagoda.fullname" .root }}-{{ .component }}{{- end -}}

{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pagoda.labels" -}}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/part-of: pagoda
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* By digest when one is given (immutable, what production should use), else by tag. */}}
{{- define "pagoda.image" -}}
{{- if .Values.image.digest -}}{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}
{{- end -}}

{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "pagoda.fullname" .) .Values.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* Addresses inside the cluster. */}}
{{- define "pagoda.schedulerAddr" -}}
{{ include "pagoda.name" (dict "root" . "component" "scheduler") }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.scheduler.port }}
{{- end -}}

{{/* Whether the model replicas run as engine pods (scheduler + worker side by side, behind a headless Service). */}}
{{- define "pagoda.replicated" -}}
{{- if or (gt (int .Values.modelReplicas.count) 1) .Values.modelReplicas.autoscaling.enabled -}}true{{- end -}}
{{- end -}}

{{/* The frontends' --scheduler-addr: the scheduler's Service, or every engine pod through the headless Service. */}}
{{- define "pagoda.frontendSchedulerAddr" -}}
{{- if include "pagoda.replicated" . -}}
dns:///{{ include "pagoda.name" (dict "root" . "component" "engine") }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.scheduler.port }}
{{- else -}}
{{ include "pagoda.schedulerAddr" . }}
{{- end -}}
{{- end -}}

{{/* The workers in rank order: the StatefulSet's pod DNS names under its headless Service. */}}
{{- define "pagoda.workerAddrs" -}}
{{- $name := include "pagoda.name" (dict "root" . "component" "worker") -}}
{{- $addrs := list -}}
{{- range $rank := until (int .Values.engine.tensorParallelSize) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $name $rank $name $.Release.Namespace $.Values.clusterDomain (int $.Values.worker.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* Tensor parallelism's rendezvous: rank 0's stable DNS name under the headless worker Service. */}}
{{- define "pagoda.distInitAddr" -}}
{{- $name := include "pagoda.name" (dict "root" . "component" "worker") -}}
{{- printf "%s-0.%s.%s.svc.%s:%d" $name $name .Release.Namespace .Values.clusterDomain (int .Values.worker.distPort) -}}
{{- end -}}

{{- define "pagoda.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}{{ .Values.tracing.otlpEndpoint }}
{{- else -}}http://{{ include "pagoda.name" (dict "root" . "component" "jaeger") }}:4317{{- end -}}
{{- end -}}

{{/* Engine settings each service reads (PAGODA_* keys of the ConfigMap that are set). */}}
{{- define "pagoda.engineEnv" -}}
{{- $e := .root.Values.engine -}}
{{- $all := dict
  "PAGODA_DTYPE" $e.dtype "PAGODA_QUANTIZATION" $e.quantization "PAGODA_DEVICE" $e.device "PAGODA_BLOCK_SIZE" $e.blockSize
  "PAGODA_KV_CACHE_MEMORY" $e.kvCacheMemory "PAGODA_GPU_MEMORY_UTILIZATION" $e.gpuMemoryUtilization
  "PAGODA_MAX_MODEL_LEN" $e.maxModelLen "PAGODA_ATTENTION_BACKEND" $e.attentionBackend
  "PAGODA_NUM_THREADS" $e.numThreads "PAGODA_SEED" $e.seed "PAGODA_MAX_NUM_SEQS" $e.maxNumSeqs
  "PAGODA_MAX_NUM_BATCHED_TOKENS" $e.maxNumBatchedTokens "PAGODA_SCHEDULING_POLICY" $e.schedulingPolicy
  "PAGODA_ASYNC_SCHEDULING" $e.asyncScheduling "PAGODA_ENABLE_PREFIX_CACHING" $e.enablePrefixCaching "PAGODA_NUM_KV_BLOCKS" $e.numKvBlocks
  "PAGODA_SPECULATIVE_CONFIG" (and $e.speculativeConfig (toJson $e.speculativeConfig))
  "PAGODA_TENSOR_PARALLEL_SIZE" $e.tensorParallelSize
  "PAGODA_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT" $e.structuredOutputsCompileTimeout
  "PAGODA_MODEL" (include "pagoda.modelPath" .root) -}}
{{- $keys := dict
  "worker" (list "PAGODA_MODEL" "PAGODA_DTYPE" "PAGODA_QUANTIZATION" "PAGODA_DEVICE" "PAGODA_BLOCK_SIZE" "PAGODA_KV_CACHE_MEMORY" "PAGODA_GPU_MEMORY_UTILIZATION" "PAGODA_MAX_MODEL_LEN" "PAGODA_ATTENTION_BACKEND" "PAGODA_NUM_THREADS" "PAGODA_SEED" "PAGODA_MAX_NUM_SEQS" "PAGODA_NUM_KV_BLOCKS" "PAGODA_TENSOR_PARALLEL_SIZE" "PAGODA_SPECULATIVE_CONFIG")
  "scheduler" (list "PAGODA_MAX_NUM_SEQS" "PAGODA_MAX_NUM_BATCHED_TOKENS" "PAGODA_SCHEDULING_POLICY" "PAGODA_ASYNC_SCHEDULING" "PAGODA_ENABLE_PREFIX_CACHING" "PAGODA_NUM_KV_BLOCKS" "PAGODA_SPECULATIVE_CONFIG" "PAGODA_TENSOR_PARALLEL_SIZE" "PAGODA_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT")
  "frontend" (list "PAGODA_MODEL") -}}
{{- $cm := include "pagoda.name" (dict "root" .root "component" "engine") -}}
{{- range $key := get $keys .component }}
{{- $v := get $all $key }}
{{- if not (kindIs "invalid" $v) }}{{ if ne (toString $v) "" }}
- name: {{ $key }}
  valueFrom:
    configMapKeyRef:
      name: {{ $cm }}
      key: {{ $key }}
{{- end }}{{ end }}
{{- end }}
{{- end -}}

{{- define "pagoda.modelPath" -}}
{{- if eq .Values.model.source "image" -}}{{ .Values.model.path }}
{{- else -}}{{ printf "%s/%s" .Values.model.mountPath .Values.model.path | trimSuffix "/" }}{{- end -}}
{{- end -}}

{{/* Environment of every Pagoda container: cache, tracing. */}}
{{- define "pagoda.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PAGODA_CACHE
  value: {{ .root.Values.cache.path | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .root.Values.tracing.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ include "pagoda.otlpEndpoint" .root | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .root.Values.tracing.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .root.Values.tracing.sampler | quote }}
- name: OTEL_SERVICE_NAME
  value: pagoda-{{ .component }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name={{ .root.Release.Namespace }},k8s.pod.name=$(POD_NAME)"
{{- end }}
{{- end -}}

{{/* Flags common to every service: tracing and TLS. */}}
{{- define "pagoda.commonArgs" -}}
{{- if and .root.Values.tracing.enabled .root.Values.tracing.detailed }}
- --collect-detailed-traces=true
{{- end }}
{{- if .root.Values.security.tls.existingSecret }}
- --tls-cert-file=/etc/pagoda/tls/tls.crt
- --tls-key-file=/etc/pagoda/tls/tls.key
- --tls-ca-file=/etc/pagoda/tls/ca.crt
{{- end }}
{{- end -}}

{{/* gRPC health probes: readiness and startup on the service's readiness name, liveness on pagoda.liveness. With
TLS the kubelet's plaintext gRPC probe cannot connect, so the probe runs in the container (exec). */}}
{{- define "pagoda.probe" -}}
{{- if .root.Values.security.tls.existingSecret }}
exec:
  command:
    - python
    - -m
    - services.common.probe
    - --addr=127.0.0.1:{{ .port }}
    - --service={{ .service }}
    - --tls-cert-file=/etc/pagoda/tls/tls.crt
    - --tls-key-file=/etc/pagoda/tls/tls.key
    - --tls-ca-file=/etc/pagoda/tls/ca.crt
    - --tls-server-name={{ .serverName }}
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service }}
{{- end }}
{{- end -}}

{{- define "pagoda.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  {{- with include "pagoda.probe" (dict "root" .root "port" .port "service" .ready "serverName" .serverName) | trim }}{{ . | nindent 2 }}{{ end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ div (int .startupSeconds) (int $p.periodSeconds) }}
readinessProbe:
  {{- with include "pagoda.probe" (dict "root" .root "port" .port "service" .ready "serverName" .serverName) | trim }}{{ . | nindent 2 }}{{ end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
livenessProbe:
  {{- with include "pagoda.probe" (dict "root" .root "port" .port "service" "pagoda.liveness" "serverName" .serverName) | trim }}{{ . | nindent 2 }}{{ end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}

{{/* Volumes every Pagoda pod mounts: /tmp, in-memory /dev/shm, cache, model, TLS, API keys. */}}
{{- define "pagoda.volumes" -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm | default "256Mi" }}
{{- if .root.Values.cache.writable }}
- name: cache
  emptyDir:
    sizeLimit: {{ .root.Values.cache.sizeLimit }}
{{- end }}
{{- if eq .root.Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.existingClaim | default (include "pagoda.name" (dict "root" .root "component" "model")) }}
    readOnly: true
{{- else if eq .root.Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .root.Values.model.hostPath }}
    type: Directory
{{- else if eq .root.Values.model.source "repository" }}
- name: model
  {{- if .root.Values.model.pvc.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.existingClaim }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .root.Values.model.repository.sizeLimit }}
  {{- end }}
{{- if and .fetch .root.Values.model.repository.tokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ .root.Values.model.repository.tokenSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .root.Values.model.repository.tokenSecret.key }}
        path: {{ .root.Values.model.repository.tokenSecret.key }}
{{- end }}
{{- end }}
{{- if .root.Values.security.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .root.Values.security.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- if and .apiKeys .root.Values.security.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ .root.Values.security.apiKeys.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "pagoda.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if .root.Values.cache.writable }}
- name: cache
  mountPath: {{ .root.Values.cache.path }}
{{- end }}
{{- if ne .root.Values.model.source "image" }}
- name: model
  mountPath: {{ .root.Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .root.Values.security.tls.existingSecret }}
- name: tls
  mountPath: /etc/pagoda/tls
  readOnly: true
{{- end }}
{{- if and .apiKeys .root.Values.security.apiKeys.existingSecret }}
- name: api-keys
  mountPath: /etc/pagoda/api-keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pagoda.podSpecCommon" -}}
serviceAccountName: {{ include "pagoda.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A component's init containers (`<component>.initContainers`): as given, with the chart's
containerSecurityContext when one sets none. */}}
{{- define "pagoda.initContainers" -}}
{{- $out := list -}}
{{- range .values.initContainers -}}
{{- $ic := deepCopy . -}}
{{- if not (hasKey $ic "securityContext") -}}
{{- $_ := set $ic "securityContext" $.root.Values.containerSecurityContext -}}
{{- end -}}
{{- $out = append $out $ic -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The init container that fills the model volume from `model.repository` (services/model_fetch.py); it alone
mounts the volume writable. */}}
{{- define "pagoda.modelFetch" -}}
{{- $m := .Values.model -}}
- name: model-fetch
  image: {{ include "pagoda.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, services.model_fetch]
  args:
    - {{ printf "--repo-url=%s" $m.repository.url | quote }}
    - {{ printf "--revision=%s" $m.repository.revision | quote }}
    - {{ printf "--dest=%s" (include "pagoda.modelPath" .) | quote }}
    {{- range $m.repository.include }}
    - {{ printf "--include=%s" . | quote }}
    {{- end }}
    {{- if $m.repository.tokenSecret.name }}
    - {{ printf "--token-file=/etc/pagoda/hf-token/%s" $m.repository.tokenSecret.key | quote }}
    {{- end }}
  resources:
    {{- toYaml $m.repository.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: dshm
      mountPath: /dev/shm
    - name: model
      mountPath: {{ $m.mountPath }}
    {{- if $m.repository.tokenSecret.name }}
    - name: hf-token
      mountPath: /etc/pagoda/hf-token
      readOnly: true
    {{- end }}
{{- end -}}

{{/* A component's pod-level fields: PriorityClass, and init containers (the model fetch first, where `fetch` and
`model.source: repository`, then the component's own). */}}
{{- define "pagoda.podExtras" -}}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- $fetch := and .fetch (eq .root.Values.model.source "repository") }}
{{- $own := include "pagoda.initContainers" . | trim }}
{{- if or $fetch $own }}
initContainers:
{{- if $fetch }}
  {{- include "pagoda.modelFetch" .root | nindent 2 }}
{{- end }}
{{- with $own }}
  {{- . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* How Prometheus reaches a /metrics endpoint: HTTPS verified with the release's CA when TLS is on (every service
then serves its metrics with its certificate), else plain HTTP. `serverName`: a Service the certificate names. */}}
{{- define "pagoda.scrapeScheme" -}}
{{- if .root.Values.security.tls.existingSecret }}
scheme: https
tlsConfig:
  ca:
    secret:
      name: {{ .root.Values.security.tls.existingSecret }}
      key: ca.crt
  serverName: {{ .serverName }}
{{- else }}
scheme: http
{{- end }}
{{- end -}}
