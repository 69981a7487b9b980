"""From readings to Prometheus: one scrape (what is read, in which order, and its
failures), the metric families of a snapshot and its readings, and the text and OpenMetrics
encoder."""
