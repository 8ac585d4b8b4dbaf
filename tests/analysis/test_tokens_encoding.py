"""``encoding_for_model``: OpenAI's mapping, the default for any other model, remembered within a bound."""

from __future__ import annotations

from llmtap.analysis import tokens
from llmtap.analysis.tokens import DEFAULT_ENCODING, MODEL_KEPT_CHARS, encoding_for_model


def test_openai_models_get_their_encoding_and_others_the_default() -> None:
    for _ in range(2):  # first looked up, then remembered: the same answer
        assert encoding_for_model("gpt-4") == "cl100k_base"
        assert encoding_for_model("gpt-4o-mini") == "o200k_base"
        assert encoding_for_model("meta-llama/Llama-3.1-8B-Instruct") == DEFAULT_ENCODING
        assert encoding_for_model("") == DEFAULT_ENCODING
        assert encoding_for_model(None) == DEFAULT_ENCODING


def test_names_clients_send_are_remembered_within_the_bound() -> None:
    tokens._remembered.cache_clear()
    for i in range(1000):
        assert encoding_for_model(f"model-{i}") == DEFAULT_ENCODING
    info = tokens._remembered.cache_info()
    assert info.currsize <= 256 and info.misses == 1000
    # A name past the kept length is answered, never kept.
    tokens._remembered.cache_clear()
    assert encoding_for_model("gpt-4-" + "x" * MODEL_KEPT_CHARS) == "cl100k_base"
    assert tokens._remembered.cache_info().currsize == 0
