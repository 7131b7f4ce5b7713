"""Properties, the engine every property runs on: the contract, the runner, checks every run gets, the long-run
settings."""
