"""Operations around the engine: start and stop a deployment, R-worker fleets, a client, the plan command."""
