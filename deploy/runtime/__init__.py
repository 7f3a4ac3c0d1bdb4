"""What the Triton model.py files import at serve time: settings, the request schema, tensor I/O,
metrics, the cache owner and the pool handle. The operator tools (launcher, bench, client, trace)
live one level up in `deploy/` and may import from here; nothing here imports a tool."""
