{{- /* Generated from services/reflow/redis_acl.py by `python -m reflow.redis_acl --chart`; a test keeps it current. Do not edit. */}}
{{- /* Each Redis user's ACL rule, less `on` and its password (redis.yaml adds both). */}}
{{- define "reflow.redisAclRules" -}}
replay: 'resetkeys ~reflow:{*}:samples ~reflow:{*}:sample_meta ~reflow:{*}:members ~reflow:{*}:meta ~reflow:{*}:seq ~reflow:{*}:unused ~reflow:{*}:replay ~reflow:{*}:by_version ~reflow:{*}:leases ~reflow:{*}:lease:* ~reflow:{*}:stats ~reflow:{*}:version ~reflow:{*}:config ~reflow:job_grants resetchannels -@all +del +evalsha +exists +get +hdel +hexists +hget +hgetall +hincrby +hmget +hset +hsetnx +script|exists +script|load +select +set +zadd +zcard +zrandmember +zrange +zrangebyscore +zrem +zscore'
scheduler: 'resetkeys ~reflow:jobs ~reflow:jobs:* ~reflow:{*}:dispatch ~reflow:{*}:inflight resetchannels -@all +evalsha +exec +hdel +hexists +hget +hgetall +hincrby +hmget +hset +hsetnx +incr +multi +script|exists +script|load +select +zadd +zrangebyscore +zremrangebyrank +zremrangebyscore +zrevrangebyscore'
{{- end -}}
{{- define "reflow.redisAdminUser" -}}default{{- end -}}
{{- define "reflow.redisAdminRule" -}}~* &* +@all{{- end -}}
