"""HTTP and HTTPS: the connection loop, the server and its paths, `/probe`, the landing
page, and the web config file (TLS, basic auth, rate limit) with its reload."""
