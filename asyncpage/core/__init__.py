"""The engine loop and everything only it touches: EngineCore (loop.py), the scheduler and its
speculation half, the model runner, the draft model, output processing, requests and sequences,
mailboxes and streams, configuration, validation and loading; the protocols the layers above are
typed against (client.py). Nothing here names the AsyncEngine facade (engine.py), which imports it."""
