"""The contract between StarSD's two daemons: wire protocol, tensor codec, verification math,
model loading and socket construction. Imports neither daemon package."""
