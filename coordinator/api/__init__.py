"""The coordinator's HTTP surface: the OpenAI API (``app.create_app``) with its Anthropic and Ollama dialects,
their schemas and error shapes, tool calling (``tools/``), the request guards and the chat page (``static/``)."""
