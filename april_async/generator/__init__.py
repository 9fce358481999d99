"""The generator actor and its engines."""
