"""The OpenAI-compatible surface: `app(engine)` (an ASGI app: /v1/completions, /v1/chat/completions,
/v1/models), `client(engine)` (an `openai.AsyncOpenAI` talking to it in-process) and `http_client(engine)`.

Typed against `asyncpage.core.client.EngineClient`; `asyncpage serve` (asyncpage/serve.py) runs `app`.
"""

try:
    from asyncpage.openai.convert import BASE_URL, MAX_PROMPTS_PER_REQUEST, MAX_REQUEST_BYTES, model_id
    from asyncpage.openai.routes import app, client, http_client
except ModuleNotFoundError as exc:  # starlette and the clients are the 'openai' extra
    raise ModuleNotFoundError(f"asyncpage.openai needs the 'openai' extra (pip install 'asyncpage[openai]'): "
                              f"{exc}", name=exc.name) from exc

__all__ = ["BASE_URL", "MAX_PROMPTS_PER_REQUEST", "MAX_REQUEST_BYTES", "app", "client", "http_client", "model_id"]
