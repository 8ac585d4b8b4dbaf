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
stream ask a token of anything beyond the pod's loopback (the token file, when admin.tokenSecret is set). */}}
{{- define "llmtap.config" -}}
{{- $admin := dict "host" "0.0.0.0" "port" .Values.service.adminPort "loopback_token" .Values.admin.loopbackToken "max_connections" .Values.admin.maxConnections "max_event_streams" .Values.admin.maxEventStreams }}
{{- if .Values.admin.tokenSecret }}
{{- $_ := set $admin "token_file" (include "llmtap.adminTokenFile" .) }}
{{- end }}
{{- $listen := dict "listen" (dict "host" "0.0.0.0" "port" .Values.service.port) "admin" $admin }}
{{- if .Values.records.enabled }}
{{- $_ := set $listen "record" (dict "path" .Values.records.mountPath) }}
{{- end }}
{{- $config := merge $listen (deepCopy .Values.config) }}
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

{{/* Where the admin token's Secret is mounted. */}}
{{- define "llmtap.adminTokenFile" -}}
/etc/llmtap-admin/{{ .Values.admin.tokenSecretKey }}
{{- end }}

{{/* The sidecar collector's config: localhost OTLP in, memory limit, batch, OTLP out. */}}
{{- define "llmtap.collectorConfig" -}}
extensions:
  health_check:
    endpoint: 127.0.0.1:13133
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
