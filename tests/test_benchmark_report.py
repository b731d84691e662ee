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


def _per_unit_run(overheads: dict, floor: float | None) -> dict:
    peers = {name: {"status": "ok", "overhead_us_per_unit": us, "time": {"median_ms": 1.0}} for name, us in overheads.items()}
    run = {"workload": "many-small-units", "world_size": 2, "peers": peers}
    if floor is not None:
        run["exchange_floor_us_per_unit"] = floor
    return {"timing": {"2": {"many-small-units": run}}}


def test_the_collectives_floor_per_unit_is_reported_with_each_peers_overhead_above_it():
    from fsbench.report import headline

    rows = dict(headline(_per_unit_run({"flatshard": 1300.0, "flatshard-fs": 1500.0, "fsdp2": 3500.0}, 1000.0)))
    assert rows["`many-small-units` W=2: overhead per unit, flatshard fully_shard / torch FSDP2"] == "0.43×"
    assert rows["`many-small-units` W=2: a unit's collectives alone (raw gloo, timed in the same rounds)"] == "1000 µs"
    above = "`many-small-units` W=2: overhead per unit above the collectives alone, flatshard fully_shard / torch FSDP2"
    assert rows[above] == "500 µs / 2500 µs = 0.20×"
    # Under the floor (fewer collectives: small units gathered and reduced together): said so, not a negative ratio
    rows = dict(headline(_per_unit_run({"flatshard": 1300.0, "flatshard-fs": 990.0, "fsdp2": 3500.0}, 1000.0)))
    assert rows[above] == ("0 µs / 2500 µs = 0.00× (10 µs under the collectives alone: fewer collectives, small units "
                           "gathered and reduced together)")
    # No floor timed (W=1, or an older run): no such rows
    rows = dict(headline(_per_unit_run({"flatshard": 1300.0, "flatshard-fs": 1500.0, "fsdp2": 3500.0}, None)))
    assert not any("collectives alone" in what for what in rows)
