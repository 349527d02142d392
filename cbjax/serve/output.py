"""A request's output text as its tokens come, cut at stop strings, and its OpenAI finish reason."""

from __future__ import annotations

from typing import Optional

from cbjax.core.request import FinishReason, Request
from cbjax.serve.text import Tokenizer

OPENAI_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.MAX_MODEL_LEN: "length",
    FinishReason.ABORTED: "abort",  # vLLM's word for a request cut short by the server
}
STOP_SEQUENCE = "stop sequence"  # the cancel reason when a stop string ends a request


class Output:
    """A request's text as its tokens come: decoded incrementally, cut at a stop string. Text
    that may still begin a stop string (the longest end of the text that starts one) is held
    until it can no longer; any other text is sent with the token that brought it."""

    def __init__(self, tokenizer: Tokenizer, req: Request, stops: list[str]):
        self.tok = tokenizer
        self.decoder = self.tok.decoder()
        self.filler = self.tok.filler_token_id
        eos = () if req.sampling.ignore_eos else self.tok.eos_token_ids
        self.silent = set(req.sampling.stop_token_ids) | set(eos)
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=1) - 1  # the most text that may be held
        self.text = ""
        self.emitted = 0
        self.num_tokens = 0
        self.stopped = False  # a stop string matched: the server ended the request

    def add(self, token_id: Optional[int]) -> str:
        """The text to send for this token (maybe empty)."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        if token_id is None:  # simulated: the filler's text, never a stop token's
            self.text += self.decoder.push(self.filler)
        elif token_id not in self.silent:  # a stop or EOS token's own text is not output
            self.text += self.decoder.push(token_id)
        if self._cut():
            return self.flush()
        end = max(self.emitted, len(self.text) - self._held())
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _held(self) -> int:
        """How many characters at the end of the text, not yet sent, may still begin a stop string."""
        text = self.text
        for n in range(min(self.longest, len(text) - self.emitted), 0, -1):
            end = text[-n:]
            if any(s.startswith(end) for s in self.stops):
                return n
        return 0

    def _cut(self) -> bool:
        """Cut the text at the first stop string in it, if any (the request then has stopped)."""
        if not self.stops:
            return False
        # a stop starting before `emitted` would have been found complete when that text was sent
        at = min((i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0), default=-1)
        if at < 0:
            return False
        self.stopped = True
        self.text = self.text[:at]
        return True

    def close(self) -> str:
        """The rest of the text once the request has ended. The decoder's held text is part of
        it: a character the last tokens left incomplete reads U+FFFD, as a decode of the whole
        output does, so the text is the decode of the tokens whatever step they ended on."""
        if not self.stopped:
            self.text += self.decoder.flush()
            self._cut()
        return self.flush()

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

    def finish_reason(self, req: Request) -> Optional[str]:
        if self.stopped:
            return "stop"
        return OPENAI_FINISH.get(req.finish_reason, "error")


def usage(req: Request, out: Output) -> dict[str, int]:
    n = out.num_tokens if out.stopped else req.num_generated
    return {"prompt_tokens": req.prompt_len, "completion_tokens": n, "total_tokens": req.prompt_len + n}
