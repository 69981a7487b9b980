{{/* The chart's name, or nameOverride. */}}
{{- define "mig-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: the release's, with the chart's name added unless it already holds it. */}}
{{- define "mig-exporter.fullname" -}}
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

{{/* What selects the pods: the same two labels deploy/k8s uses. */}}
{{- define "mig-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mig-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels: the selector's, deploy/k8s's part-of, and Helm's own. */}}
{{- define "mig-exporter.labels" -}}
{{ include "mig-exporter.selectorLabels" . }}
app.kubernetes.io/part-of: mig-exporter
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mig-exporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mig-exporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The config file's ConfigMap: the user's, or the chart's. */}}
{{- define "mig-exporter.configMapName" -}}
{{- default (include "mig-exporter.fullname" .) .Values.config.existingConfigMap }}
{{- end }}

{{/* The TLS Secret: the user's, or the chart's from tls.cert and tls.key. */}}
{{- define "mig-exporter.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "mig-exporter.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* Whether the server reads a web config: TLS, basic auth, or the user's own. */}}
{{- define "mig-exporter.webConfig" -}}
{{- if or .Values.tls.enabled .Values.basicAuth.users .Values.webConfig.existingSecret }}true{{ end }}
{{- end }}

{{/* Basic auth may be asked for: the kubelet's probes cannot answer it. */}}
{{- define "mig-exporter.basicAuth" -}}
{{- if or .Values.basicAuth.users .Values.webConfig.existingSecret }}true{{ end }}
{{- end }}

{{- define "mig-exporter.webConfigSecretName" -}}
{{- default (printf "%s-web-config" (include "mig-exporter.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{/*
How the kubelet checks a pod: a GET of the path (over HTTPS with TLS on), or, with basic auth,
only that the port is open, since the kubelet cannot log in. The argument is (list $ path).
*/}}
{{- define "mig-exporter.probeHandler" -}}
{{- $root := index . 0 -}}
{{- if include "mig-exporter.basicAuth" $root -}}
tcpSocket:
  port: metrics
{{- else -}}
httpGet:
  path: {{ index . 1 }}
  port: metrics
  {{- if $root.Values.tls.enabled }}
  scheme: HTTPS
  {{- end }}
{{- end }}
{{- end }}

{{- define "mig-exporter.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* The exporter's log level words: the chart says "warn", as most charts do. */}}
{{- define "mig-exporter.logLevel" -}}
{{- if eq .Values.logLevel "warn" }}warning{{ else }}{{ .Values.logLevel }}{{ end }}
{{- end }}

{{/* Milliseconds in a Prometheus duration (1m30s, 500ms), to compare two of them. */}}
{{- define "mig-exporter.ms" -}}
{{- $units := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000 "w" 604800000 "y" 31536000000 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+(ms|s|m|h|d|w|y)" . -1 -}}
{{- $total = add $total (mul (regexFind "^[0-9]+" . | atoi) (get $units (regexReplaceAll "^[0-9]+" . ""))) -}}
{{- end -}}
{{- $total -}}
{{- end }}

{{/*
A scrape timeout longer than its interval makes the Prometheus Operator drop the whole
monitor, with no more than an event to say so. The argument is
(list monitor-name interval-value-name interval timeout).
*/}}
{{- define "mig-exporter.validateTimeout" -}}
{{- $name := index . 0 }}{{ $intervalName := index . 1 }}{{ $interval := index . 2 }}{{ $timeout := index . 3 }}
{{- if gt (include "mig-exporter.ms" $timeout | atoi) (include "mig-exporter.ms" $interval | atoi) }}
{{- fail (printf "%s.scrapeTimeout (%s) is longer than %s (%s): the Prometheus Operator would drop the whole monitor; make the timeout at most the interval" $name $timeout $intervalName $interval) }}
{{- end }}
{{- end }}

{{/*
Refusals the schema cannot word well: checked once, by the DaemonSet's template.
*/}}
{{- define "mig-exporter.validate" -}}
{{- with .Values.updateStrategy.rollingUpdate }}
{{- if and (eq $.Values.updateStrategy.type "RollingUpdate") .maxSurge (ne (toString .maxSurge) "0") .maxUnavailable (ne (toString .maxUnavailable) "0") }}
{{- fail "updateStrategy.rollingUpdate: Kubernetes refuses maxSurge beside a maxUnavailable other than 0 (the default is 1); set updateStrategy.rollingUpdate.maxUnavailable=0 with maxSurge" }}
{{- end }}
{{- end }}
{{- range $name := list "serviceMonitor" "podMonitor" }}
{{- $monitor := index $.Values $name }}
{{- if $monitor.enabled }}
{{- include "mig-exporter.validateTimeout" (list $name (printf "%s.interval" $name) $monitor.interval $monitor.scrapeTimeout) }}
{{- if and $.Values.probe.scrape $.Values.probe.interval }}
{{- include "mig-exporter.validateTimeout" (list $name "probe.interval" $.Values.probe.interval $monitor.scrapeTimeout) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled .Values.podMonitor.enabled }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled are both true: every pod would be scraped twice; set one of them to false" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) }}
{{- fail "serviceMonitor.enabled needs service.enabled: a ServiceMonitor finds the pods through the Service; set service.enabled=true, or use podMonitor.enabled instead" }}
{{- end }}
{{- if and .Values.probe.scrape (not (or .Values.serviceMonitor.enabled .Values.podMonitor.enabled)) }}
{{- fail "probe.scrape needs serviceMonitor.enabled or podMonitor.enabled: the probe targets are scraped through one of them" }}
{{- end }}
{{- if and .Values.probe.scrape .Values.config.existingConfigMap }}
{{- fail "probe.scrape scrapes probe.targets, which config.existingConfigMap replaces: name the targets in probe.targets, or scrape them with a job of your own (docs/probe.md)" }}
{{- end }}
{{- end }}
