import json
import logging
from http.server import BaseHTTPRequestHandler, HTTPServer

HOST = "127.0.0.1"
PORT = 8080
LOG_LEVEL = logging.INFO


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"status": "ok"}).encode())
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, format, *args):
        logging.info(format, *args)


def main():
    logging.basicConfig(level=LOG_LEVEL)
    server = HTTPServer((HOST, PORT), Handler)
    logging.info("listening on %s:%d", HOST, PORT)
    server.serve_forever()


if __name__ == "__main__":
    main()
