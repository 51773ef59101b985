"""The documented commands' runs are `slow` and selected only by ``-m slow`` (they launch dozens of jobs).

Why not in the default run like the other `slow` tests: each block starts torchrun jobs (~10 s
each on 2 cores), some benchmarks; the whole set takes many minutes, over the suite's budget
(docs/testing.md). ``python -m pytest -m slow tests/docs`` runs them; the default run keeps the
marker checks (under a second).
"""


def pytest_collection_modifyitems(session, config, items):
    if "slow" in (config.option.markexpr or ""):
        return
    kept, dropped = [], []
    for item in items:
        runs_documented_commands = item.get_closest_marker("docs_commands") is not None
        (dropped if runs_documented_commands and item.get_closest_marker("slow") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
