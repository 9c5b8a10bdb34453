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

{{- define "reflow.redisUserPasswordKey" -}}
{{- printf "%s-password" . -}}
{{- end -}}

{{/* One Redis user's URL and password (dict "root" $ "user" "replay"|"scheduler", the
users of _redis_acl.tpl): the Secret's key of that user alone. */}}
{{- define "reflow.redisEnv" -}}
{{- $root := .root }}
{{- if not (hasKey (include "reflow.redisAclRules" $root | fromYaml) .user) }}
{{- fail (printf "reflow.redisEnv: %q is not a Redis user of _redis_acl.tpl" .user) }}
{{- end }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "reflow.redisSecretName" $root }}
      key: {{ include "reflow.redisUserPasswordKey" .user }}
{{- if $root.Values.redis.enabled }}
- name: REDIS_URL
  value: {{ printf "redis://%s:$(REDIS_PASSWORD)@%s-redis:6379/0" .user (include "reflow.fullname" $root) | quote }}
{{- else }}
{{- with $root.Values.redis.external }}
{{- if not .host }}
{{- fail "redis.external.host is required when redis.enabled is false" }}
{{- end }}
- name: REDIS_URL
  value: {{ printf "%s://%s:$(REDIS_PASSWORD)@%s:%d/%d" (ternary "rediss" "redis" .tls) $.user .host (int .port) (int .db) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "reflow.apiSecretName" -}}
{{- default (printf "%s-api-token" (include "reflow.fullname" .)) .Values.api.auth.existingSecret -}}
{{- end -}}

{{/* Ports */}}
{{- define "reflow.schedulerPort" -}}50051{{- end -}}
{{- define "reflow.replayPort" -}}50052{{- end -}}
{{- define "reflow.workerPort" -}}50060{{- end -}}
{{- define "reflow.sandboxPort" -}}50080{{- end -}}
{{- define "reflow.apiPort" -}}8000{{- end -}}

{{/* gRPC auth (reflow.rpcauth) and TLS */}}
{{- define "reflow.grpcSecretName" -}}
{{- default (printf "%s-grpc-auth" (include "reflow.fullname" .)) .Values.grpcAuth.existingSecret -}}
{{- end -}}

{{/* TLS identities (reflow.tlscerts): a certificate per role, naming the role as
`<role>.reflow.internal`; an AsyncHybrid worker serves the Rollout and Trainer services
too, so its certificate names those roles as well. Role -> its certificate's names. */}}
{{- define "reflow.tlsRoles" -}}
api: [api.reflow.internal]
scheduler: [scheduler.reflow.internal]
replay: [replay.reflow.internal]
worker: [worker.reflow.internal, rollout.reflow.internal, trainer.reflow.internal]
sandbox: [sandbox.reflow.internal]
{{- end -}}

{{/* Each role's certificate is the Secret `<prefix>-<role>`. */}}
{{- define "reflow.tlsSecretPrefix" -}}
{{- default (printf "%s-grpc-tls" (include "reflow.fullname" .)) .Values.tls.existingSecretPrefix -}}
{{- end -}}

{{/* The Secret a service's pods mount its certificate from: (dict "root" $ "service" NAME). */}}
{{- define "reflow.tlsSecretName" -}}
{{- if not (hasKey (include "reflow.tlsRoles" .root | fromYaml) .service) }}
{{- fail (printf "reflow.tlsSecretName: %q is not a role of reflow.tlsRoles" .service) }}
{{- end }}
{{- if .root.Values.tls.secretName -}}
{{- .root.Values.tls.secretName -}}
{{- else -}}
{{- printf "%s-%s" (include "reflow.tlsSecretPrefix" .root) .service -}}
{{- end -}}
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
- name: REFLOW_TLS
  value: "on"
- name: REFLOW_TLS_CERT_FILE
  value: /var/run/secrets/reflow/tls/tls.crt
- name: REFLOW_TLS_KEY_FILE
  value: /var/run/secrets/reflow/tls/tls.key
- name: REFLOW_TLS_CA_FILE
  value: /var/run/secrets/reflow/tls/ca.crt
{{- if .root.Values.tls.secretName }}
- name: REFLOW_TLS_SERVER_NAME
  value: {{ .root.Values.tls.serverName | quote }}
{{- end }}
- name: REFLOW_GRPC_HEALTH_PORT
  value: {{ include "reflow.grpcHealthPort" .root | quote }}
{{- else }}
- name: REFLOW_TLS
  value: "off"
{{- end }}
{{- end -}}

{{- define "reflow.grpcVolumeMounts" -}}
- {name: grpc-auth, mountPath: /var/run/secrets/reflow/grpc, readOnly: true}
{{- if .Values.tls.enabled }}
- {name: grpc-tls, mountPath: /var/run/secrets/reflow/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* Each signing role mounts its own private key only; every pod the public keys; and
each service its own TLS certificate and key: (dict "root" $ "role" "scheduler"|"api"|""
"service" NAME), the service defaulting to the role. */}}
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
    secretName: {{ include "reflow.tlsSecretName" (dict "root" .root "service" (.service | default .role)) }}
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
