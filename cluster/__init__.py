"""The application: config, app builder, OpenAI ingress, routing, local cluster, CLI."""
