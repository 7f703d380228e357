"""megamoe inside other frameworks. Each integration is imported on its own (its framework is an optional
dependency): `import megamoe.integrations.transformers` registers the Hugging Face experts implementation."""
