{{/* Names */}}
{{- define "reflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "reflow.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "reflow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels. Call the component variants with (dict "root" $ "component" "api"). */}}
{{- define "reflow.labels" -}}
helm.sh/chart: {{ include "reflow.chart" .root }}
{{ include "reflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: reflow
{{- end -}}

{{- define "reflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "reflow.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Images */}}
{{- define "reflow.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{- printf "%s:%s-%s" .root.Values.image.repository $tag .flavor -}}
{{- end -}}

{{- define "reflow.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "reflow.controlPlaneScheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem: HOME and caches live in /tmp. */}}
{{- define "reflow.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: VLLM_CACHE_ROOT
  value: /tmp/vllm
- name: REFLOW_METRICS_PORT
  value: {{ .Values.metricsPort | quote }}
- name: REFLOW_LOG_LEVEL
  value: INFO
{{- end -}}

{{/* Redis */}}
{{- define "reflow.redisSecretName" -}}
{{- default (printf "%s-redis" (include "reflow.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "reflow.redisEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "reflow.redisSecretName" . }}
      key: {{ .Values.redis.auth.passwordKey }}
{{- if .Values.redis.enabled }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "reflow.fullname" .) | quote }}
{{- else }}
{{- if not .Values.redis.external.host }}
{{- fail "redis.external.host is required when redis.enabled is false" }}
{{- end }}
- name: REDIS_URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s:%d/%d" (ternary "rediss" "redis" .Values.redis.external.tls) .Values.redis.external.host (int .Values.redis.external.port) (int .Values.redis.external.db) | quote }}
{{- end }}
{{- end -}}

{{- define "reflow.apiSecretName" -}}
{{- default (printf "%s-api-token" (include "reflow.fullname" .)) .Values.api.auth.existingSecret -}}
{{- end -}}

{{/* Ports */}}
{{- define "reflow.schedulerPort" -}}50051{{- end -}}
{{- define "reflow.replayPort" -}}50052{{- end -}}
{{- define "reflow.workerPort" -}}50060{{- end -}}
{{- define "reflow.apiPort" -}}8000{{- end -}}

{{/* gRPC auth (reflow.rpcauth) and TLS */}}
{{- define "reflow.grpcSecretName" -}}
{{- default (printf "%s-grpc-auth" (include "reflow.fullname" .)) .Values.grpcAuth.existingSecret -}}
{{- end -}}

{{- define "reflow.tlsSecretName" -}}
{{- default (printf "%s-grpc-tls" (include "reflow.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{/* Env of a service: (dict "root" $ "role" "scheduler"|"api"|"") - the scheduler and the
API sign their calls with their own key (reflow.capabilities); every gRPC server verifies the
scheduler's calls with its public key, and the scheduler the API's. */}}
{{- define "reflow.grpcEnv" -}}
- name: REFLOW_GRPC_CREDENTIAL_FILE
  value: /var/run/secrets/reflow/grpc/credential
{{- if .role }}
- name: REFLOW_{{ upper .role }}_SIGNING_KEY_FILE
  value: /var/run/secrets/reflow/grpc/{{ .role }}-signing-key
{{- end }}
- name: REFLOW_SCHEDULER_PUBLIC_KEY_FILE
  value: /var/run/secrets/reflow/grpc/scheduler-public-key
{{- if eq .role "scheduler" }}
- name: REFLOW_API_PUBLIC_KEY_FILE
  value: /var/run/secrets/reflow/grpc/api-public-key
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: REFLOW_TLS_CERT_FILE
  value: /var/run/secrets/reflow/tls/tls.crt
- name: REFLOW_TLS_KEY_FILE
  value: /var/run/secrets/reflow/tls/tls.key
- name: REFLOW_TLS_CA_FILE
  value: /var/run/secrets/reflow/tls/ca.crt
- name: REFLOW_TLS_SERVER_NAME
  value: {{ .root.Values.tls.serverName | quote }}
- name: REFLOW_GRPC_HEALTH_PORT
  value: {{ include "reflow.grpcHealthPort" .root | quote }}
{{- end }}
{{- end -}}

{{- define "reflow.grpcVolumeMounts" -}}
- {name: grpc-auth, mountPath: /var/run/secrets/reflow/grpc, readOnly: true}
{{- if .Values.tls.enabled }}
- {name: grpc-tls, mountPath: /var/run/secrets/reflow/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* Each signing role mounts its own private key only; every pod the public keys. */}}
{{- define "reflow.grpcVolumes" -}}
- name: grpc-auth
  secret:
    secretName: {{ include "reflow.grpcSecretName" .root }}
    items:
      - {key: credential, path: credential}
      - {key: scheduler-public-key, path: scheduler-public-key}
      {{- if .role }}
      - {key: {{ .role }}-signing-key, path: {{ .role }}-signing-key}
      {{- end }}
      {{- if eq .role "scheduler" }}
      - {key: api-public-key, path: api-public-key}
      {{- end }}
{{- if .root.Values.tls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ include "reflow.tlsSecretName" .root }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{/* Kubelet's gRPC probe speaks plaintext: with TLS on, services answer health
checks (and nothing else) on a port of their own. */}}
{{- define "reflow.grpcHealthPort" -}}50070{{- end -}}
{{- define "reflow.grpcProbePort" -}}
{{- if .root.Values.tls.enabled }}{{ include "reflow.grpcHealthPort" .root }}{{ else }}{{ .port }}{{ end -}}
{{- end -}}
