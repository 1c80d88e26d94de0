"""KV tiers below an engine's block pool: host memory, local disk, a shared file system. The tier connector
(``tiers.connector``) decides and keeps each tier's index (``tiers.index``); the tiers' worker
(``tiers.worker``) moves the bytes, to block files (``tiers.block_file``) or pinned host memory."""
