"""`/openapi.json`: an OpenAPI 3.1 document of every request body, generated from the protocols'
request models. Its own module, above them all, so that no protocol's models import another's."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from api.anthropic.request import MessagesRequestModel
from api.openai.tokenize import DetokenizeRequestModel, TokenizeRequestModel
from api.request.models import ChatCompletionRequest, CompletionRequestModel
from api.responses.request import ResponsesRequestModel

REQUEST_BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequestModel,
    "/tokenize": TokenizeRequestModel,
    "/detokenize": DetokenizeRequestModel,
    "/v1/responses": ResponsesRequestModel,
    "/v1/messages": MessagesRequestModel,
    "/v1/messages/count_tokens": MessagesRequestModel,
}


def openapi_schema(version: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document of the request bodies."""
    _, schemas = models_json_schema(
        [(model, "validation") for model in dict.fromkeys(REQUEST_BODIES.values())],
        ref_template="#/components/schemas/{model}",
    )
    paths = {
        path: {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                },
                "responses": {"200": {"description": "OK"}, "400": {"description": "OpenAI error body naming `param`"}},
            }
        }
        for path, model in REQUEST_BODIES.items()
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "fp4serve", "version": version},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
