"""rstar-jax's code-execution service: isolated warm-pool Python execution over HTTP, and its client (SPEC 2, 6).

Run a server:  `python -m sandbox_server --host 127.0.0.1 --port 8080 [--workers N] [--gin_file F] [--gin_param B]`
(as root, for namespaces and cgroups; `--allow-unisolated` otherwise). Endpoints: POST /run, POST /run_batch,
GET /health, GET /metrics. Use it from asyncio code through `sandbox_server.client.SandboxClient`, which implements
the `ToolExecutor` protocol of `sandbox_server.api` and returns `ToolResult`s (never raises for tool failures).

Layout: api (wire schema, ToolResult, ToolExecutor), config (gin), http_app (front end), pool (queue, slots),
zygote (per-slot warm process and per-call supervision), confinement + linux (isolation), exposure (what of the
host, such as a venv under /tmp, the isolated workers still see), cgroups, outcome (status), snippet (IPython-like
execution), framing (server<->zygote messages), client, preflight (isolation and worker-interpreter checks at start).
The package imports nothing of `rstar_jax`; to start a server as a child process in its own PID namespace (tests,
experiments, benchmarks) use `rstar_jax.processes.running_sandbox`, which runs the command line above.
"""
