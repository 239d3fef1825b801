"""The engine-side contract the transfer path needs from a KV cache manager, a reference
paged block pool with a prefix index, and block-hash schemes."""
