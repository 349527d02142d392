"""cbjax-bench: a load client for any OpenAI-compatible server, writing cbjax's run files."""
