"""Stream Mixture-of-Experts weights from disk under a memory budget."""
