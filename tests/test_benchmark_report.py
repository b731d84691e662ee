"""benchmarks/: what a publishing run keeps of RESULTS.md.

A full run rewrites RESULTS.md's top (the run's tables and plots) and keeps what is below the marker. A hand-written
section added above the marker (between the tables and the plots, as the file reads) must not be lost: the run
keeps it, moved to just below the marker.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

from fsbench.report import KEPT_MARKER, kept_sections  # noqa: E402


def test_a_publishing_run_keeps_every_hand_written_section():
    old = "\n".join([
        "# Benchmark results", "", "### Headline", "| a | b |", "",
        "## A session's reading (written by hand)", "", "its text", "",
        "## Plots", "", "![x](results/x.png)", "",
        KEPT_MARKER, "## GPU", "", "gpu text", "",
        "## An older session", "", "older text", ""])
    kept = kept_sections(old)
    assert kept.startswith(KEPT_MARKER)
    assert "## A session's reading (written by hand)\n\nits text" in kept
    assert "## Plots" not in kept and "### Headline" not in kept and "![x]" not in kept
    assert kept.index("## A session's reading") < kept.index("## GPU") < kept.index("## An older session")
    assert kept.endswith("## An older session\n\nolder text\n")
    # Kept again by the next run: nothing above the marker any more, nothing lost or doubled
    again = kept_sections("# Benchmark results\n\n## Plots\n\n" + kept)
    assert again == kept


def test_a_file_without_the_marker_keeps_nothing():
    assert kept_sections("# Benchmark results\n\n## Plots\n") == ""
