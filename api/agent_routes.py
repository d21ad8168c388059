"""The routes of the agent-facing front-ends: OpenAI's Responses API and Anthropic's Messages
API, both over the chat pipeline (api/routes.py `start_chat`)."""

from __future__ import annotations

from starlette.routing import Route

from api.anthropic_routes import count_tokens, create_message
from api.responses_routes import create_response, delete_response, get_response

AGENT_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
