{{/* Names and labels, defined once (every template uses these). */}}

{{- define "llmtap.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmtap.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llmtap.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmtap.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmtap.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "llmtap.labels" -}}
helm.sh/chart: {{ include "llmtap.chart" . }}
{{ include "llmtap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "llmtap.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llmtap.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "llmtap.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The llmtap config file: the values' settings plus the listen and admin sections the chart owns. The admin
listener binds every address of the pod so the probes and Prometheus reach it; its span receiver and event
stream ask a token of anything beyond the pod's loopback (LLMTAP_ADMIN_TOKEN, from its Secret, when one is given). With a
model server in the pod (modelServer.enabled), its one route goes to it over the pod's loopback. */}}
{{- define "llmtap.config" -}}
{{- $admin := dict "host" "0.0.0.0" "port" .Values.service.adminPort "loopback_token" .Values.admin.loopbackToken "max_connections" .Values.admin.maxConnections "max_event_streams" .Values.admin.maxEventStreams }}
{{- $listen := dict "listen" (dict "host" "0.0.0.0" "port" .Values.service.port) "admin" $admin }}
{{- if .Values.records.enabled }}
{{- $_ := set $listen "record" (dict "path" .Values.records.mountPath) }}
{{- end }}
{{- $config := merge $listen (deepCopy .Values.config) }}
{{- with .Values.modelServer }}
{{- if .enabled }}
{{- $_ := set $config "routes" (list (dict "prefix" "/" "upstream" (printf "http://127.0.0.1:%v" .port) "provider" .provider)) }}
{{- end }}
{{- end }}
{{- with .Values.clickhouse }}
{{- if .url }}
{{- $record := dict "clickhouse" .url "clickhouse_table" .table "clickhouse_ttl_days" .ttlDays "clickhouse_queue" .queue }}
{{- if .user }}
{{- $_ := set $record "clickhouse_user" .user }}
{{- end }}
{{- $_ := set $config "record" (merge (get $config "record" | default dict) $record) }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* A secret every replica must share, as {name, key} of the Secret the pods read: the existing Secret named in
values, else the chart's own Secret when the value itself is given, else nothing. The pods read each as an
environment variable (secretKeyRef), so every replica and every restart has the same one. Called with a list: the root
context, the values' section, the section's name (for messages), the value's field and the key in the chart's
Secret. */}}
{{- define "llmtap.secretRef" -}}
{{- $root := index . 0 }}
{{- $section := index . 1 }}
{{- $name := index . 2 }}
{{- $value := get $section (index . 3) }}
{{- if and $value $section.existingSecret }}
{{- fail (printf "%s: give %s.%s or %s.existingSecret, not both" $name $name (index . 3) $name) }}
{{- end }}
{{- if $section.existingSecret }}
name: {{ $section.existingSecret }}
key: {{ $section.existingSecretKey }}
{{- else if $value }}
{{- if lt (len $value) 16 }}
{{- fail (printf "%s.%s: at least 16 characters" $name (index . 3)) }}
{{- end }}
name: {{ include "llmtap.fullname" $root }}
key: {{ index . 4 }}
{{- end }}
{{- end }}

{{/* The admin token's Secret ({name, key}), empty when none is given. */}}
{{- define "llmtap.adminSecret" -}}
{{- include "llmtap.secretRef" (list . .Values.admin "admin" "token" "admin-token") }}
{{- end }}

{{/* The peers' shared token's Secret ({name, key}), empty when none is given. */}}
{{- define "llmtap.peerSecret" -}}
{{- include "llmtap.secretRef" (list . .Values.peers "peers" "token" "peer-token") }}
{{- end }}

{{/* The API-key fingerprints' secret's Secret ({name, key}), empty when none is given. */}}
{{- define "llmtap.attributionSecret" -}}
{{- include "llmtap.secretRef" (list . .Values.attribution "attribution" "key" "attribution-key") }}
{{- end }}

{{/* The shutdown budget, seconds: the pre-stop wait, llmtap's drain of open streams, its telemetry flush (recording
what the relays handed over, then the exporters, all within the one bound timeouts.flush, however many parts do not
answer) and 5 s of margin for the processes' own exit. terminationGracePeriodSeconds is this when null,
and may not be less when given. */}}
{{- define "llmtap.shutdownBudget" -}}
{{- $timeouts := .Values.config.timeouts }}
{{- add .Values.preStopSleepSeconds (ceil $timeouts.drain) (ceil $timeouts.flush) 5 }}
{{- end }}

{{/* terminationGracePeriodSeconds: the value given (checked against the budget) or the budget. */}}
{{- define "llmtap.gracePeriod" -}}
{{- $budget := include "llmtap.shutdownBudget" . | int }}
{{- $given := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $given }}
{{- $budget }}
{{- else if lt (int $given) $budget }}
{{- fail (printf "terminationGracePeriodSeconds %v is less than the shutdown budget %v s: preStopSleepSeconds %v + config.timeouts.drain %v + config.timeouts.flush %v + 5 s of margin (null: the budget)" $given $budget .Values.preStopSleepSeconds .Values.config.timeouts.drain .Values.config.timeouts.flush) }}
{{- else }}
{{- $given }}
{{- end }}
{{- end }}

{{/* The sidecar collector's config: localhost OTLP in, memory limit, batch, OTLP out. */}}
{{- define "llmtap.collectorConfig" -}}
extensions:
  health_check:
    # Every address of the pod: the kubelet probes the pod IP, not its loopback.
    endpoint: 0.0.0.0:13133
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:4317
      http:
        endpoint: 127.0.0.1:4318
processors:
  memory_limiter:
    check_interval: 1s
    limit_percentage: 80
    spike_limit_percentage: 20
  batch:
    send_batch_size: 8192
    timeout: 200ms
exporters:
  otlp_grpc:
    endpoint: {{ .Values.collector.sidecar.endpoint }}
    compression: gzip
    tls:
      insecure: {{ .Values.collector.sidecar.insecure }}
service:
  extensions: [health_check]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [memory_limiter, batch]
      exporters: [otlp_grpc]
    metrics:
      receivers: [otlp]
      processors: [memory_limiter, batch]
      exporters: [otlp_grpc]
{{- end }}
