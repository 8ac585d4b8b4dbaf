"""``bench.probes.relay_cpu``'s variants: ``--gather`` and ``--env`` become the settings each tree runs with, in
turn."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.probes.relay_cpu import Variant, main, variants


def test_no_variant_asked_is_the_defaults_alone() -> None:
    assert variants(Namespace(gather=None, env=None)) == [Variant()]


def test_gather_and_env_variants_run_side_by_side() -> None:
    got = variants(Namespace(gather=[0], env=["on:LLMTAP_A=1, LLMTAP_B=x", "off:LLMTAP_A=0"]))
    assert got == [
        Variant("gather=0ms", (("LLMTAP_TELEMETRY_GATHER", "0"),), 0),
        Variant("on", (("LLMTAP_A", "1"), ("LLMTAP_B", "x"))),
        Variant("off", (("LLMTAP_A", "0"),)),
    ]


@pytest.mark.parametrize("given", ["no-colon", ":LLMTAP_A=1", "label:", "label:=1"])
def test_a_malformed_env_variant_is_refused(given: str) -> None:
    with pytest.raises(SystemExit, match="LABEL:KEY=VALUE"):
        main(["--env", given, "--rounds", "0"])
