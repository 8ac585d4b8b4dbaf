"""OpenAI Responses as vLLM serves it: named, numbered events, usage only on ``response.completed``; with a
reasoning summary item first when ``reasoning`` is asked for, and a function call item when ``tools`` are given.

Each output item is opened (``response.output_item.added``), filled by its deltas and closed
(``response.output_item.done``) before the next opens, as OpenAI's stream does (standards D.3): a reasoning item
with its summary part (``response.reasoning_summary_text.delta``), then the answer, a message with its text part
(``response.output_text.delta``) or a function call (``response.function_call_arguments.delta``).
"""

from __future__ import annotations

from typing import Any

from llmtap.simulator.parts import arguments_piece, tool_call_id
from llmtap.simulator.shapes import SSE_TYPE, Reply, dumps, openai_error, sse

__all__ = ["ResponsesFormat"]


class ResponsesFormat:
    """OpenAI Responses as vLLM serves it: named, numbered events; usage only on ``response.completed``.

    An answer that stops on its length is ``status: incomplete`` with ``incomplete_details.reason``
    ``max_output_tokens``, yet vLLM still ends the stream with ``response.completed`` (as recorded).
    """

    id_prefix = "resp_"
    stream_type = SSE_TYPE
    error = staticmethod(openai_error)

    def _item_id(self, r: Reply, kind: str = "msg_") -> str:
        # An item's id shares the response's hex digits: unique per response, no second draw.
        return kind + r.id.removeprefix(self.id_prefix)

    def _answer_index(self, r: Reply) -> int:
        """The answer item's place in ``output``: after the reasoning item when there is one."""
        return 1 if r.reasoning_tokens else 0

    def _event(self, r: Reply, kind: str, fields: dict[str, Any]) -> bytes:
        obj = fields | {"sequence_number": r.events, "type": kind}
        r.events += 1
        return sse(dict(sorted(obj.items())), kind)

    def _usage(self, r: Reply) -> dict[str, Any]:
        return {
            "input_tokens": r.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": r.cached_tokens,
                # No cache writes are billed by automatic prefix caching (0 in the recording too).
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": r.output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": r.reasoning_tokens,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": r.prompt_tokens + r.output_tokens,
        }

    def _part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def _reasoning_item(self, r: Reply, done: bool) -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": r.reasoning_text}] if done else []
        return {"id": self._item_id(r, "rs_"), "summary": summary, "type": "reasoning"}

    def _call_item(self, r: Reply, text: str | None) -> dict[str, Any]:
        return {
            "arguments": "" if text is None else arguments_piece(text, first=True, last=True),
            "call_id": tool_call_id(r.id, "call_"),
            "name": r.tool,
            "type": "function_call",
            "id": self._item_id(r, "fc_"),
            "status": "in_progress" if text is None else "completed",
        }

    def _item(self, r: Reply, text: str | None) -> dict[str, Any]:
        if r.tool is not None:
            return self._call_item(r, text)
        content = [] if text is None else [self._part(text, None)]
        status = "in_progress" if text is None else "completed"
        return {
            "id": self._item_id(r),
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    def _response(self, r: Reply, text: str | None) -> dict[str, Any]:
        """The ``response`` object: in progress (no output, no usage) or done (``text`` given)."""
        done = text is not None
        return {
            "id": r.id,
            "created_at": r.created,
            "incomplete_details": {"reason": "max_output_tokens"} if done else None,
            "instructions": None,
            "metadata": None,
            "model": r.model,
            "object": "response",
            "output": self._output(r, text) if text is not None else [],
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "none",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": r.output_tokens,
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": "incomplete" if done else "in_progress",
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": self._usage(r) if done else None,
            "user": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _output(self, r: Reply, text: str) -> list[dict[str, Any]]:
        reasoning = [self._reasoning_item(r, done=True)] if r.reasoning_tokens else []
        return [*reasoning, self._item(r, text)]

    def prelude(self, r: Reply) -> list[bytes]:
        """response.created and .in_progress, then the first item opened: the reasoning, else the answer."""
        started = [
            self._event(r, "response.created", {"response": self._response(r, None)}),
            self._event(r, "response.in_progress", {"response": self._response(r, None)}),
        ]
        return started + (self._open_reasoning(r) if r.reasoning_tokens else self._open_answer(r))

    def _open_reasoning(self, r: Reply) -> list[bytes]:
        where = {"item_id": self._item_id(r, "rs_"), "output_index": 0, "summary_index": 0}
        part = {"type": "summary_text", "text": ""}
        return [
            self._event(r, "response.output_item.added", {"item": self._reasoning_item(r, False), "output_index": 0}),
            self._event(r, "response.reasoning_summary_part.added", where | {"part": part}),
        ]

    def _close_reasoning(self, r: Reply) -> list[bytes]:
        where = {"item_id": self._item_id(r, "rs_"), "output_index": 0, "summary_index": 0}
        part = {"type": "summary_text", "text": r.reasoning_text}
        item = {"item": self._reasoning_item(r, True), "output_index": 0}
        return [
            self._event(r, "response.reasoning_summary_text.done", where | {"text": r.reasoning_text}),
            self._event(r, "response.reasoning_summary_part.done", where | {"part": part}),
            self._event(r, "response.output_item.done", item),
        ]

    def _open_answer(self, r: Reply) -> list[bytes]:
        index = self._answer_index(r)
        added = self._event(r, "response.output_item.added", {"item": self._item(r, None), "output_index": index})
        if r.tool is not None:
            return [added]
        where = {"item_id": self._item_id(r), "output_index": index, "content_index": 0}
        return [added, self._event(r, "response.content_part.added", where | {"part": self._part("", [])})]

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """One delta: reasoning summary text, output text or function-call arguments; the reasoning item closes
        and the answer's opens before the answer's first delta."""
        part = r.part(done)
        if part == "reasoning":
            where = {"item_id": self._item_id(r, "rs_"), "output_index": 0, "summary_index": 0}
            return [self._event(r, "response.reasoning_summary_text.delta", where | {"delta": text})]
        out = [] if r.answering or not r.reasoning_tokens else [*self._close_reasoning(r), *self._open_answer(r)]
        first, r.answering = not r.answering, True
        index = self._answer_index(r)
        if part == "tool":
            where = {"item_id": self._item_id(r, "fc_"), "output_index": index}
            piece = arguments_piece(text, first=first, last=done == r.output_tokens)
            return [*out, self._event(r, "response.function_call_arguments.delta", where | {"delta": piece})]
        where = {"content_index": 0, "item_id": self._item_id(r), "output_index": index}
        return [*out, self._event(r, "response.output_text.delta", where | {"delta": text, "logprobs": []})]

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """The answer's deltas and item marked done, then ``response.completed`` with the usage (numbered in order)."""
        index = self._answer_index(r)
        if r.tool is not None:
            where = {"item_id": self._item_id(r, "fc_"), "output_index": index}
            arguments = arguments_piece(text, first=True, last=True)
            out = [self._event(r, "response.function_call_arguments.done", where | {"arguments": arguments})]
        else:
            where = {"content_index": 0, "item_id": self._item_id(r), "output_index": index}
            out = [
                self._event(r, "response.output_text.done", where | {"logprobs": [], "text": text}),
                self._event(r, "response.content_part.done", where | {"part": self._part(text, None)}),
            ]
        out.append(self._event(r, "response.output_item.done", {"item": self._item(r, text), "output_index": index}))
        out.append(self._event(r, "response.completed", {"response": self._response(r, text)}))
        return out

    def body(self, r: Reply, text: str) -> bytes:
        """A ``response`` object."""
        return dumps(self._response(r, text))
