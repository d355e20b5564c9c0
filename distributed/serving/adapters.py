"""The APIs served besides OpenAI's completions and chat (see api_adapter.py), by route:
generation routes (ADAPTERS), plain ones (ROUTES: fn(body, scheduler, tokenizer, info)
-> (status, JSON)), and each route's error shape (ERROR_BODIES: fn(ApiError) -> JSON)."""

from . import anthropic_api, ollama_api, responses_api

ADAPTERS = {**responses_api.ADAPTERS, **anthropic_api.ADAPTERS, **ollama_api.ADAPTERS}
ROUTES = {**responses_api.ROUTES, **anthropic_api.ROUTES, **ollama_api.ROUTES}
ERROR_BODIES = {**responses_api.ERROR_BODIES, **anthropic_api.ERROR_BODIES, **ollama_api.ERROR_BODIES}
