"""The job's meta-device build holds no more than it keeps: ``--init-model-with-meta-device`` through the
adapter peaks at most at this rank's persistent state plus the largest unit in fp32 (+5%), as the engine's
own build does (tests/engine/test_meta_init.py::test_meta_build_peak_memory_is_bounded)."""

import argparse

from tools import meta_init_peak


def test_job_meta_build_peak_memory_is_bounded():
    """``tools/meta_init_peak.py``'s job build (Megatron-Core's GPT, untied head, ZeRO-3) on 2 fresh ranks,
    glibc's defaults: the largest unit is the root (embedding and head), and Megatron-Core's CPU
    initialiser, replayed as it is, would hold its master weight and a ``torch.cat`` copy beside the
    parameter (ratio ~1.2 here)."""
    shape = argparse.Namespace(layers=2, hidden=512, vocab=4096)
    for rank, row in enumerate(meta_init_peak.launch("job", 2, shape)):
        m = row["meta"]
        assert row["eager"]["peak"] >= m["model"], row  # the instrument sees the full model in the eager build
        assert meta_init_peak.ratio(row) <= 1.05, \
            f"rank {rank}: meta build peak {m['peak'] / 2**20:.1f} MiB > 1.05 x (persistent " \
            f"{m['persistent'] / 2**20:.1f} MiB + largest unit {m['unit'] / 2**20:.1f} MiB): {row}"
        assert m["after"] <= 1.05 * m["persistent"], row
