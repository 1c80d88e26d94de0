"""KV tiers below an engine's block pool: host memory, local disk, a shared file system, each behind one
interface (``tiers.base.Tier``), composed by the tier connector (``tiers.connector``)."""
