"""cbjax-serve: an OpenAI-compatible HTTP server over cbjax's scheduler and either executor."""
