"""pipeline's Hydra plugins (Hydra finds plugins only under the ``hydra_plugins`` namespace package)."""
