"""The web console: ``agent-reach console`` and ``up --console`` (:mod:`.app`)."""
