"""Coverage-guided fuzzing (atheris) of the decoders and every provider parser, fed like the relay feeds them.

``python tests/support/fuzz_parsers.py -runs=N -max_len=4096`` (libFuzzer flags). Each input picks a framing and a
provider, is cut into network chunks, decoded, and every event goes to the provider's stream parser and,
whole, to its body parser and request inspector. Any exception is a finding: libFuzzer stops and prints it.
``tests/providers/test_hostile.py`` runs it where atheris installs.
"""

from __future__ import annotations

import json
import sys

import atheris

with atheris.instrument_imports():
    from llmtap.providers import PROVIDERS, UsageEventFilter
    from llmtap.providers.sse import decoder_for

FRAMINGS = ("sse", "ndjson", "json-array")
INT64_MAX = 2**63 - 1


def check(facts: object) -> None:
    """Token counts are absent or fit OTLP's int64: anything else would break the export."""
    usage = getattr(facts, "usage", None)
    if usage is None:
        return
    for value in (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens, usage.cache_write_tokens):
        if value is not None and not (isinstance(value, int) and 0 <= value <= INT64_MAX):
            raise AssertionError(f"token count out of range: {value!r}")


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    framing = FRAMINGS[fdp.ConsumeIntInRange(0, len(FRAMINGS) - 1)]
    provider = PROVIDERS[fdp.ConsumeIntInRange(0, len(PROVIDERS) - 1)]
    cuts = sorted(fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 6)))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    decoder = decoder_for(framing, max_bytes=512)
    usage_filter = UsageEventFilter(max_held=512)
    parser = provider.stream_parser()
    start = 0
    relayed = b""
    for cut in [*cuts, len(body)]:
        piece = body[start : max(start, min(cut, len(body)))]
        start += len(piece)
        relayed += usage_filter.feed(piece)
        for event in decoder.feed(piece):
            check(parser.feed(event))
    for event in decoder.flush():
        check(parser.feed(event))
    relayed += usage_filter.flush()
    if b'"choices"' not in body and relayed != body:
        raise AssertionError("the usage filter changed bytes that hold no usage event")
    check(provider.parse_body(body))
    info = provider.inspect(body, inject_usage=True, path="/v1/chat/completions")
    if info.rewritten_body is not None:
        json.loads(info.rewritten_body)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
