"""The user SDK: what an agent, env or workflow author imports (`shared.sdk.agent`, `shared.sdk.types`)."""
