"""`higgs-trt serve`: OpenAI's speech API over the in-flight scheduler.

  app.py            the routes (Starlette) and each request's audio from the engine thread to its response body
  speech_api.py     the API's request body, checked field by field, and its errors
  engine_thread.py  the one thread that owns the engine and runs the scheduler's loop
  metrics.py        Prometheus metrics
  voices.py         named voices (`--voices DIR`)
  h11_connection.py uvicorn's h11 protocol with header and connection limits (uvicorn internals: pinned release)
  run.py            listening, draining on SIGTERM
"""
