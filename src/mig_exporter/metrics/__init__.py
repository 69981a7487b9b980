"""From readings to Prometheus: one scrape (what is read, in which order, and its
failures), the metric families of a snapshot and its readings, the text and OpenMetrics
encoder, and the exporter that composes them into the answer serve and read give."""
