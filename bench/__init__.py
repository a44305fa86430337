"""oncepatch benchmark harness (``scripts/bench``): side-by-side figures against git.

Modules:

* :mod:`bench.env` — hermetic environment, paths, the machine description;
* :mod:`bench.stats` — median / p90 / ratios; interleaved A B A B rounds;
* :mod:`bench.repos` — generated repositories (git fast-import) and patches;
* :mod:`bench.cases_apply` — one-file patches, replays, large changes;
* :mod:`bench.cases_store` — recover / verify / watcher over synthetic stores;
* :mod:`bench.fsyncs` — fsync counts and fsync time (strace, fsync-stub A/B);
* :mod:`bench.profiling` — cProfile / importtime hotspots;
* :mod:`bench.report` — markdown tables and the target check;
* :mod:`bench.worker` — the code run in child processes (memory peaks, A/B).

Nothing here is imported by the product; the product is imported only
through its public faces (``patcher.protocol.apply``, the CLI, and the
receipt record types for synthesising stores).
"""
