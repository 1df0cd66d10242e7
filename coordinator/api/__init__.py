"""The coordinator's HTTP surface: the OpenAI API (``app.create_app``) with its Anthropic and Ollama dialects,
their schemas and error shapes, tool calling (``tools/``), the request guards, the chat page (``static/``) and
what the port serves while a planned fleet is prepared (``preparing_page``)."""
