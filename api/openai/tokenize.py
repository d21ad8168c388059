"""vLLM's POST /tokenize and /detokenize with the server's own tokenizer: their request models and
handlers. They live at the root as in vLLM, so they check the API key themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, model_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.access.keys import token_from_headers, unauthorized_message
from api.errors import APIError, bad_request
from api.http import json_response, read_json, server_state
from api.pipeline import check_model
from api.request.messages import parse_messages, parse_tools
from api.request.models import template_kwargs, token_id_list
from api.request.validation import Bool, RequestModel, Str, ToolsRequest, validate

if TYPE_CHECKING:
    from engine.front import InputProcessor


class TokenizeRequestModel(ToolsRequest):
    """A prompt as it is, or chat messages through the chat template as /v1/chat/completions
    renders them (exactly one of the two)."""

    prompt: Str | None = None
    messages: Any = None
    add_generation_prompt: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: Bool | None = None
    add_special_tokens: Bool | None = None
    return_token_strs: Bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_of_prompt_and_messages(cls, body: Any) -> Any:
        if isinstance(body, dict):
            if body.get("prompt") is None and body.get("messages") is None:
                raise bad_request("send a prompt (a string) or messages (a chat) to tokenize", "messages")
            if body.get("prompt") is not None and body.get("messages") is not None:
                raise bad_request("send a prompt or messages, not both", "prompt")
        return body

    @model_validator(mode="after")
    def _normalised(self) -> TokenizeRequestModel:
        template_kwargs(self.chat_template_kwargs, self.enable_thinking)
        if self.messages is None:
            return self
        return self.model_copy(update={"messages": parse_messages(self.messages), "tools": parse_tools(self.tools)})

    @property
    def with_special_tokens(self) -> bool:
        """vLLM's defaults: a prompt gets the tokenizer's special tokens, a rendered chat does not."""
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequestModel(RequestModel):
    tokens: Annotated[Any, AfterValidator(token_id_list)] = None


async def tokenize(request: Request) -> Response:
    """vLLM's POST /tokenize: `tokens`, `count` and `max_model_len` (and `token_strs` on request)."""
    state = server_state(request)
    _check_api_key(request)
    engine = state.ready_engine()
    req = validate(TokenizeRequestModel, await read_json(request), state.config.limits)
    check_model(req.model, engine)
    token_ids = await state.run_blocking(_tokenize, engine.input_processor, req)
    body: dict[str, Any] = {"tokens": token_ids, "count": len(token_ids), "max_model_len": engine.info.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = [engine.tokenizer.backend.id_to_token(t) for t in token_ids]
    return json_response(body)


def _tokenize(inputs: InputProcessor, req: TokenizeRequestModel) -> list[int]:
    """Blocking (run it off the loop). NOTE: messages go through the same template call as
    InputProcessor.render_chat (`chat_text`: late system messages folded where the template needs),
    so the count equals a chat request's usage.prompt_tokens. A prompt too long to serve is still
    counted: nothing here is refused for its length."""
    tokenizer = inputs.tokenizer
    assert tokenizer is not None, "the server's input processor has the checkpoint's tokenizer"
    if req.messages is None:
        assert req.prompt is not None, "a tokenize request holds a prompt or messages"
        return tokenizer.encode(req.prompt, add_special_tokens=req.with_special_tokens)
    text = inputs.chat_text(
        req.messages,
        req.tools,
        req.add_generation_prompt is not False,
        template_kwargs(req.chat_template_kwargs, req.enable_thinking),
    )
    return tokenizer.encode(text, add_special_tokens=req.with_special_tokens)


async def detokenize(request: Request) -> Response:
    """vLLM's POST /detokenize: token ids back to text, special tokens included."""
    state = server_state(request)
    _check_api_key(request)
    engine = state.ready_engine()
    req = validate(DetokenizeRequestModel, await read_json(request))
    token_ids = _token_ids(req.tokens, engine.tokenizer.vocab_size)
    check_model(req.model, engine)
    text = await state.run_blocking(engine.tokenizer.decode, token_ids, False)
    return json_response({"prompt": text})


def _token_ids(tokens: list[int] | None, vocab_size: int) -> list[int]:
    """NOTE: /detokenize never reaches the engine, so its ids are checked against the vocabulary here."""
    if tokens is None:
        raise bad_request("tokens must be a list of token ids", "tokens")
    bad = next((x for x in tokens if not 0 <= x < vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens has token id {bad}, outside the vocabulary [0, {vocab_size})", "tokens")
    return list(tokens)


def _check_api_key(request: Request) -> None:
    """NOTE: api/access/keys.py's middleware guards /v1/* only, and these routes live at the root as in
    vLLM: they check the same keys, the same way, themselves."""
    token, sent = token_from_headers(request.scope["headers"])
    if server_state(request).keys.lookup(token) is None:
        raise APIError(401, unauthorized_message(sent), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


TOKENIZE_ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
