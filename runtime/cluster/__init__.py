"""`serve --cluster`: the same server (runtime/server/) over engine replicas in Ray Serve, one engine per GPU.

  ingress.py  ClusterEngine: the engine seam of runtime/server/engine_thread.py, backed by the replicas
  job.py      RemoteJob: one request a replica runs, as the routes see it
  replica.py  EngineReplica: the deployment; each replica owns an EngineThread; the events it streams back
  routing.py  VoiceAffinityRouter: fewest streams, a voice's requests on its own replica within a bound
  deploy.py   Ray and Serve: joining or starting the cluster, the deployment's options, teardown
  metrics.py  /metrics with every replica's figures under a replica label
"""
