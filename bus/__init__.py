"""The only package that imports `nats`: connections, the embedded server, stream and
consumer declarations, event append/read, the catalog bucket, and error mapping."""
