"""``rlm serve``: an OpenAI-compatible HTTP endpoint where each chat completion is one RLM run.

The package's modules, top to bottom: :mod:`rlm.serve.server` (the app, its routes, run slots
and the command's flags), :mod:`rlm.serve.request` (a request body as a run),
:mod:`rlm.serve.runs` (one client call, one run: retries, hang-ups, usage),
:mod:`rlm.serve.sessions` (``"rlm": {"session": ID}``) and :mod:`rlm.serve.errors` (the
protocol's error shapes, upstream failures in the server's words, key redaction). Nothing is
imported here, so that importing one part does not import the server.
"""
