"""StarSD draft daemon: one draft model serving many target daemons over a ZeroMQ ROUTER socket."""
