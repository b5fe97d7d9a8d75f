"""Plan cache: in-memory LRU over a disk cache shared by processes."""
