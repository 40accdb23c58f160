#include "http_server.h"

#include <httplib.h>
#include <signal.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "certkv/certkv.hpp"
#include "client_connection.h"
#include "connection.h"
#include "dashboard_page.h"
#include "meter_history.h"
#include "openai_protocol.h"
#include "request_scheduler.h"
#include "server_metrics.h"

namespace certkv::server {

namespace {

// Connections the kernel queues for accept (see HttpServer::bind); 64 clients starting at once fit.
constexpr int kListenBacklog = 1024;

// How long a handler waits for text before it looks at its client (and, streaming, writes a
// keep-alive comment).
constexpr std::chrono::milliseconds kClientCheckInterval{500};
// Decode steps of the dashboard's heatmap (the engine's meter_recent_steps).
constexpr int32_t kDashboardMeterSteps = 64;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& res, const OpenAiError& e) { send_json(res, e.http_status, error_body(e)); }

// A refusal sent before the request's body is read, for a body httplib would never read or could
// not bound (chunked, compressed, on a method without a body). The connection is closed after it:
// left open, the unread body would be parsed as the next request on it, a request smuggled past
// the checks. cpp-httplib 0.11 keeps a connection open whatever the response's Connection header
// says, and closes it when a content provider fails: this chunked one writes the whole error body
// and its last chunk, then reports failure. (Chunked, httplib applies no Range header to it.) A
// HEAD response has no body to fail: the connection (connection.h) closes after the response all
// the same.
void refuse_before_the_body(httplib::Response& res, const OpenAiError& e) {
  if (Connection* c = current_connection()) c->close_after_response();
  res.status = e.http_status;
  auto body = std::make_shared<std::string>(dump(error_body(e)));
  res.set_header("Connection", "close");
  res.set_chunked_content_provider("application/json", [body](size_t, httplib::DataSink& sink) {
    sink.write(body->data(), body->size());
    sink.done();
    return false;
  });
}

// A refusal decided from the headers of a request whose body httplib reads (a bounded
// Content-Length): made after the body is read, so the connection stays usable and a client still
// sending a large body gets the answer rather than a reset. The pre-routing handler leaves it
// here (one per worker thread, one request at a time) and the route, or the error handler when
// none matches, sends it.
thread_local std::optional<OpenAiError> t_refusal;

// A POST route's handler, run only when the request was not refused.
httplib::Server::Handler unless_refused(httplib::Server::Handler handler) {
  return [handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
    if (t_refusal) {
      send_error(res, *t_refusal);
      t_refusal.reset();
      return;
    }
    handler(req, res);
  };
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

json parse_body(const httplib::Request& req) {
  try {
    return json::parse(req.body);
  } catch (const json::exception& e) {  // a syntax error, or a number past double's range
    throw OpenAiError(400, "invalid_request_error", "invalid_json", "",
                      std::string("the body is not valid JSON: ") + e.what());
  }
}

}  // namespace

// Everything load() makes, and what the handlers share.
class ServerState {
 public:
  enum class Phase { kLoading, kReady, kFailed };

  std::atomic<Phase> phase{Phase::kLoading};
  std::mutex failure_mutex;
  std::string failure;  // kFailed: why

  std::unique_ptr<certkv::Model> model;
  certkv_model_info info{};
  std::string model_id;  // the model file's name, as /v1/models lists it
  int64_t loaded_unix_seconds = 0;
  int64_t context_tokens = 0;
  certkv_engine* engine = nullptr;
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<MeterHistory> meter_history;
  std::unique_ptr<RequestScheduler> scheduler;
  CertificateContext certificate;
  std::atomic<int64_t> next_request{1};

  ~ServerState() {
    scheduler.reset();  // joins the thread before the engine goes
    if (engine) certkv_engine_free(engine);
  }
};

HttpServer::HttpServer(ServerOptions options)
    : options_(std::move(options)),
      http_(std::make_unique<ConnectionServer>(request_timeout(options_))),
      state_(std::make_unique<ServerState>()) {
  install_routes();
}

HttpServer::~HttpServer() {
  stop();
  state_.reset();
}

int HttpServer::bind() {
  // Debian's cpp-httplib is a compiled library whose bind listens with a backlog of 5, fixed when
  // it was built (CPPHTTPLIB_LISTEN_BACKLOG in this unit cannot reach it): connections arriving
  // together past that are reset, as 64 streaming clients starting at once found on a busy machine.
  // The socket-options hook sees the socket before bind; a second listen() on the bound socket
  // sets its backlog (Linux updates the backlog of a listening socket).
  socket_t listening = INVALID_SOCKET;
  http_->set_socket_options([&listening](socket_t sock) {
    httplib::default_socket_options(sock);
    listening = sock;
  });
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
  } else {
    port_ = http_->bind_to_port(options_.host, options_.port) ? options_.port : -1;
  }
  http_->set_socket_options(httplib::default_socket_options);
  if (port_ <= 0)
    throw std::runtime_error("cannot listen on " + options_.host + ":" + std::to_string(options_.port));
  if (::listen(listening, kListenBacklog) != 0)
    throw std::runtime_error("listen(backlog " + std::to_string(kListenBacklog) + ") on " + options_.host + ":" +
                             std::to_string(port_) + ": " + std::strerror(errno));
  return port_;
}

void HttpServer::listen() { http_->listen_after_bind(); }

void HttpServer::stop() {
  if (state_->phase == ServerState::Phase::kReady) state_->scheduler->cancel_all();
  http_->stop();
}

void HttpServer::load() {
  ServerState& s = *state_;
  try {
    s.model = std::make_unique<certkv::Model>(options_.model_path);
    s.info = s.model->info();
    s.model_id = std::filesystem::path(options_.model_path).filename().string();
    certkv_engine_params p = certkv_engine_default_params();
    p.session.context_tokens = options_.ctx_tokens;
    p.session.n_threads = options_.threads;
    p.session.kv = options_.kv.c_str();
    p.session.witness = options_.witness.empty() ? nullptr : options_.witness.c_str();
    p.session.meter_tau = options_.tau;
    p.session.gate = options_.gate ? 1 : 0;
    p.session.meter = options_.meter ? 1 : 0;
    p.session.sparse_p = options_.sparse_p;
    p.session.sparse_window = options_.sparse_window;
    p.session.sparse_dense_layers = options_.sparse_dense_layers;
    p.session.device = options_.device.c_str();
    p.max_sequences = options_.parallel;
    p.step_tokens = options_.step_tokens;
    p.pool_bytes = options_.pool_bytes;
    p.meter_recent_steps = options_.meter ? kDashboardMeterSteps : 0;
    certkv::check(certkv_engine_create(s.model->get(), &p, &s.engine));
    s.context_tokens = options_.ctx_tokens > 0 ? options_.ctx_tokens : s.info.context_length;
    s.certificate.scheme = options_.kv;
    s.certificate.meter_tier = "none";
    for (int32_t i = 0; i < certkv_kv_scheme_count(); ++i) {
      certkv_kv_scheme_info k;
      if (certkv_kv_scheme_get(i, &k) == CERTKV_OK && options_.kv == k.name && options_.meter)
        s.certificate.meter_tier = k.meter_tier;
    }
    s.certificate.tau = options_.tau;
    s.certificate.gate = options_.gate;
    s.certificate.sparse = options_.sparse_p > 0;
    s.metrics = std::make_unique<ServerMetrics>(options_.kv, options_.tau, options_.sparse_p > 0);
    s.meter_history = std::make_unique<MeterHistory>(kDashboardMeterSteps, s.info.n_layers, s.info.n_heads);
    s.scheduler = std::make_unique<RequestScheduler>(s.engine, s.metrics.get(), s.meter_history.get());
    s.loaded_unix_seconds = unix_seconds();
    s.phase = ServerState::Phase::kReady;
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(s.failure_mutex);
      s.failure = e.what();
    }
    s.phase = ServerState::Phase::kFailed;
    throw std::runtime_error(e.what());
  }
}

namespace {

// The prompt's tokens: the chat template for messages, the text or token ids as given otherwise.
std::vector<int32_t> prompt_tokens(const ServerState& s, const CompletionRequest& r) {
  if (!r.chat && !r.prompt_tokens.empty()) {
    for (size_t i = 0; i < r.prompt_tokens.size(); ++i)
      if (r.prompt_tokens[i] >= s.info.n_vocab)
        throw invalid_field("prompt", "token " + std::to_string(r.prompt_tokens[i]) + " at " + std::to_string(i) +
                                          " is outside the vocabulary of " + std::to_string(s.info.n_vocab));
    return r.prompt_tokens;
  }
  std::vector<int32_t> tokens;
  if (r.chat) {
    // The template's turn markers parsed, the messages' text as text (a message cannot open a turn).
    std::vector<certkv_chat_message> messages;
    for (const ChatMessage& m : r.messages) messages.push_back({m.role.c_str(), m.content.c_str()});
    try {
      tokens = s.model->chat_tokens(messages, true);
    } catch (const certkv::ApiError& e) {
      throw invalid_field("messages", std::string("the model's chat template refused them: ") + e.what());
    }
  } else {
    tokens = s.model->tokenize(r.prompt, true, true);
  }
  if (tokens.empty()) throw invalid_field(r.chat ? "messages" : "prompt", "the prompt has no token");
  return tokens;
}

OpenAiError context_exceeded(const CompletionRequest& r, const std::string& message) {
  return OpenAiError(400, "invalid_request_error", "context_length_exceeded", r.chat ? "messages" : "prompt", message);
}

}  // namespace

void HttpServer::install_routes() {
  httplib::Server& http = *http_;
  ServerState& s = *state_;
  const ServerOptions& options = options_;
  const size_t n_threads =
      size_t(options.http_threads > 0 ? options.http_threads : std::max(32, options.parallel * 4));
  http.new_task_queue = [n_threads] { return new httplib::ThreadPool(n_threads); };
  http.set_payload_max_length(size_t(options.max_body_bytes));

  // A request's head is in (the connection gave it its deadline): its body, if any, may take the
  // timeout and once more per 64 KiB received; without one, the server's time begins.
  http.set_pre_routing_handler([&s, &options, timeout = request_timeout(options)](const httplib::Request& req,
                                                                                  httplib::Response& res) {
    t_refusal.reset();
    if (Connection* c = current_connection()) {
      c->note_routed();
      if (std::strtoull(req.get_header_value("Content-Length").c_str(), nullptr, 10) > 0)
        c->expect_body(timeout);
      else
        c->clear_deadline();
    }
    auto refuse = [&res](const OpenAiError& e) {
      refuse_before_the_body(res, e);
      return httplib::Server::HandlerResponse::Handled;
    };
    // cpp-httplib holds a body to max_body_bytes by its Content-Length alone: a chunked body (with
    // a Content-Length beside it or not), a body without a length (read to the connection's end)
    // and a compressed one (inflated as it is read) would come in whole whatever their size. All
    // are refused before the body is read, on every path.
    if (req.has_header("Content-Encoding") && req.get_header_value("Content-Encoding") != "identity")
      return refuse(OpenAiError(415, "invalid_request_error", "unsupported_content_encoding", "",
                                "compressed request bodies are not accepted: send the JSON as it is"));
    const bool has_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" || req.method == "DELETE";
    if (req.has_header("Transfer-Encoding") || (has_body && !req.has_header("Content-Length")))
      return refuse(OpenAiError(411, "invalid_request_error", "length_required", "",
                                "a request body needs a Content-Length (chunked bodies are not accepted)"));
    // httplib reads no body for GET, HEAD or OPTIONS.
    if (!has_body && req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0")
      return refuse(OpenAiError(400, "invalid_request_error", "unexpected_body", "",
                                "a " + req.method + " request carries no body"));
    // The health check, and the dashboard page, which holds no data (it asks /dashboard/state).
    if ((req.path == "/health" || req.path == "/") && req.method == "GET")
      return httplib::Server::HandlerResponse::Unhandled;
    std::optional<OpenAiError> refusal;
    if (!options.api_key.empty() && req.get_header_value("Authorization") != "Bearer " + options.api_key)
      refusal = OpenAiError(401, "authentication_error", "invalid_api_key", "",
                            "a missing or wrong API key: send 'Authorization: Bearer KEY'");
    else if (s.phase != ServerState::Phase::kReady)
      refusal = OpenAiError(503, "server_error", "model_not_ready", "",
                            s.phase == ServerState::Phase::kLoading ? "the model is loading" : "the model failed to load");
    if (!refusal) return httplib::Server::HandlerResponse::Unhandled;
    if (!has_body) {
      send_error(res, *refusal);
      return httplib::Server::HandlerResponse::Handled;
    }
    t_refusal = std::move(refusal);
    return httplib::Server::HandlerResponse::Unhandled;
  });

  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [&options](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.content_provider_) return httplib::Server::HandlerResponse::Unhandled;
    if (t_refusal) {  // a refused request for which no route matched, its body read
      const OpenAiError refusal = *t_refusal;
      t_refusal.reset();
      if (res.status == 404) {
        send_error(res, refusal);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    std::string message = "HTTP " + std::to_string(res.status);
    std::string code;
    if (res.status == 404) {
      message = "no endpoint " + req.method + " " + req.path;
      code = "not_found";
    } else if (res.status == 413) {
      message = "the request body is over the limit of " + std::to_string(options.max_body_bytes) + " bytes";
      code = "request_too_large";
    }
    send_error(res, OpenAiError(res.status, res.status >= 500 ? "server_error" : "invalid_request_error", code,
                                "", message));
    return httplib::Server::HandlerResponse::Handled;
  }));

  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const OpenAiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, OpenAiError(500, "server_error", "", "", e.what()));
    }
  });

  http.Get("/health", [&s](const httplib::Request&, httplib::Response& res) {
    switch (s.phase.load()) {
      case ServerState::Phase::kReady:
        send_json(res, 200, {{"status", "ok"}});
        break;
      case ServerState::Phase::kLoading:
        send_json(res, 503, {{"status", "loading"}});
        break;
      case ServerState::Phase::kFailed: {
        std::lock_guard lock(s.failure_mutex);
        send_json(res, 503, {{"status", "error"}, {"message", s.failure}});
        break;
      }
    }
  });

  http.Get("/v1/models", [&s](const httplib::Request&, httplib::Response& res) {
    json model{{"id", s.model_id},
               {"object", "model"},
               {"created", s.loaded_unix_seconds},
               {"owned_by", "certkv"},
               {"meta",
                {{"architecture", s.info.architecture},
                 {"n_layers", s.info.n_layers},
                 {"n_vocab", s.info.n_vocab},
                 {"context_tokens", s.context_tokens},
                 {"kv", s.certificate.scheme},
                 {"meter_tier", s.certificate.meter_tier}}}};
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  });

  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_content(kDashboardPage, "text/html; charset=utf-8");
  });

  http.Get("/dashboard/state", [&s](const httplib::Request&, httplib::Response& res) {
    const certkv_engine_stats e = s.metrics->engine_stats();
    const ServerMetrics::Totals t = s.metrics->totals();
    json classes = json::array();
    uint64_t bytes_in_use = 0;
    for (int32_t i = 0; i < e.n_classes_in_use; ++i) {
      classes.push_back({{"class", e.in_use[i].storage},
                         {"pages", e.in_use[i].pages_in_use},
                         {"bytes", e.in_use[i].page_bytes_in_use}});
      bytes_in_use += e.in_use[i].page_bytes_in_use;
    }
    json meter = s.meter_history->to_json();
    meter["capacity"] = kDashboardMeterSteps;
    meter["metered"] = s.certificate.meter_tier != "none";
    send_json(res, 200,
              {{"model", s.model_id},
               {"scheme", s.certificate.scheme},
               {"meter_tier", s.certificate.meter_tier},
               {"tau", s.certificate.tau},
               {"gate", s.certificate.gate},
               {"requests",
                {{"running", e.running},
                 {"waiting", e.waiting},
                 {"finished", t.finished},
                 {"rejected", t.rejected},
                 {"prompt_tokens", t.prompt_tokens},
                 {"generated_tokens", t.generation_tokens}}},
               {"kv",
                {{"pages_in_use", e.live_pages_in_use},
                 {"pages_cached", e.pool_pages_in_use - e.live_pages_in_use},
                 {"capacity_pages", e.pool_capacity_pages},
                 {"usage_ratio", e.pool_capacity_pages > 0
                                     ? double(e.live_pages_in_use) / double(e.pool_capacity_pages) : 0.0},
                 {"classes", classes},
                 {"compression_ratio_vs_bf16",
                  bytes_in_use > 0 ? json(double(e.page_bytes_as_bf16) / double(bytes_in_use)) : json(nullptr)}}},
               {"meter", meter}});
  });

  http.Get("/metrics", [&s, &connections = *http_](const httplib::Request&, httplib::Response& res) {
    s.metrics->set_timed_out_connections(connections.timed_out());
    res.set_content(s.metrics->prometheus_text(), "text/plain; version=0.0.4");
  });

  http.Post("/tokenize", unless_refused([&s](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    if (!body.is_object() || !body.contains("content") || !body["content"].is_string())
      throw invalid_field("content", "expected a string");
    auto flag = [&](const char* name, bool fallback) {
      if (!body.contains(name)) return fallback;
      if (!body[name].is_boolean()) throw invalid_field(name, "expected true or false");
      return body[name].get<bool>();
    };
    const bool add_special = flag("add_special", false);
    const bool parse_special = flag("parse_special", true);
    const std::vector<int32_t> tokens = s.model->tokenize(body["content"].get<std::string>(), add_special, parse_special);
    send_json(res, 200, {{"tokens", tokens}});
  }));

  http.Post("/detokenize", unless_refused([&s](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array())
      throw invalid_field("tokens", "expected an array of token ids");
    bool render_special = true;  // llama-server's: /tokenize parses them, so they come back
    if (body.contains("render_special")) {
      if (!body["render_special"].is_boolean()) throw invalid_field("render_special", "expected true or false");
      render_special = body["render_special"].get<bool>();
    }
    const json& tokens = body["tokens"];
    std::vector<int32_t> ids;
    ids.reserve(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      const std::string param = "tokens[" + std::to_string(i) + "]";
      if (!tokens[i].is_number_integer()) throw invalid_field(param, "expected an integer");
      const int64_t t = tokens[i].get<int64_t>();
      if (t < 0 || t >= s.info.n_vocab)
        throw invalid_field(param, std::to_string(t) + " is outside the vocabulary of " + std::to_string(s.info.n_vocab));
      ids.push_back(int32_t(t));
    }
    send_json(res, 200, {{"content", s.model->detokenize(ids, render_special)}});
  }));

  auto completion = [&s](bool chat) {
    return [&s, chat](const httplib::Request& req, httplib::Response& res) {
      const CompletionRequest r = parse_completion_request(parse_body(req), chat);
      if (!r.model.empty() && r.model != s.model_id)
        throw OpenAiError(404, "invalid_request_error", "model_not_found", "model",
                          "model '" + r.model + "' is not served here; GET /v1/models lists '" + s.model_id + "'");
      GenerationRequest g;
      g.prompt = prompt_tokens(s, r);
      const int64_t n_prompt = int64_t(g.prompt.size());
      if (n_prompt >= s.context_tokens)
        throw context_exceeded(r, "the prompt has " + std::to_string(n_prompt) + " tokens; the context holds " +
                                      std::to_string(s.context_tokens) + " (prompt and output)");
      g.max_tokens = r.max_tokens ? *r.max_tokens : chat ? int32_t(s.context_tokens - n_prompt) : 16;
      g.sampler = r.sampler;
      g.stop = r.stop;
      g.ignore_end = r.ignore_eos;
      g.per_layer = r.per_layer;
      g.logprobs = r.logprobs;
      g.stream = r.stream;
      g.prompt_logprobs = r.echo && r.logprobs >= 0;
      const std::vector<int32_t> prompt = r.echo ? g.prompt : std::vector<int32_t>();
      const std::shared_ptr<RequestChannel> channel = s.scheduler->submit(std::move(g));
      const RequestChannel::Submission sub = channel->wait_submitted();
      if (sub.status == CERTKV_ERR_OUT_OF_RANGE) throw context_exceeded(r, sub.error);
      if (sub.status == CERTKV_ERR_INVALID_ARGUMENT) throw OpenAiError(400, "invalid_request_error", "", "", sub.error);
      if (sub.status != CERTKV_OK) throw OpenAiError(500, "server_error", "", "", sub.error);

      const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(s.next_request++);
      const int64_t created = unix_seconds();
      const auto connection = std::make_shared<ClientConnection>(current_connection() ? int(current_connection()->socket()) : -1);
      // A token's text for log-probabilities: its piece, a control token's text.
      const TokenText token_text = [&s](int32_t t) {
        std::string piece = s.model->piece(t);
        return piece.empty() ? s.model->detokenize({t}, true) : piece;
      };
      if (!r.stream) {
        std::string ignored;
        while (!channel->wait_for_text(&ignored, kClientCheckInterval)) {
          ignored.clear();
          if (!channel->cancel_requested() && connection->closed()) {
            channel->request_cancel();
            s.scheduler->notify_cancel();
          }
        }
        const GenerationResult& result = channel->result();
        // Cancelled: the client is gone, or the server is stopping (then it hears so).
        if (result.finish_reason == "cancelled")
          throw OpenAiError(503, "server_error", "", "", "the request was cancelled: the server is stopping");
        if (result.finish_reason == "error") throw OpenAiError(500, "server_error", "", "", result.error);
        const std::string prompt_text =
            !r.echo ? std::string() : r.prompt_tokens.empty() ? r.prompt : s.model->detokenize(prompt, true);
        send_json(res, 200, completion_response(r, id, created, s.model_id, result, s.certificate, prompt, prompt_text,
                                                 token_text));
        return;
      }
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [&s, r, id, created, channel, connection, token_text, first = true,
           text_offset = size_t(0)](size_t, httplib::DataSink& sink) mutable {
            auto send_event = [&](const std::string& payload) {
              const std::string event = "data: " + payload + "\n\n";
              return sink.write(event.data(), event.size());
            };
            for (;;) {
              std::string text;
              std::vector<certkv_token_logprob> tokens;  // their log-probabilities, when asked for
              const bool finished = channel->wait_for_text(&text, kClientCheckInterval, r.logprobs >= 0 ? &tokens : nullptr);
              // A write to a client that has hung up may still succeed (the kernel buffers it), so
              // the connection is looked at before every write: the request is cancelled at the
              // first token after the hang-up.
              bool written = !connection->closed();
              if (written && (!text.empty() || first || !tokens.empty())) {
                const json logprobs = tokens.empty() ? json(nullptr) : stream_logprobs(r, tokens, token_text, &text_offset);
                written = send_event(dump(completion_chunk(r, id, created, s.model_id, text, first, "", nullptr, logprobs)));
                first = false;
              } else if (written && !finished) {
                written = sink.write(": keep-alive\n\n", 14);
              }
              if (!written) {
                channel->request_cancel();
                s.scheduler->notify_cancel();
                return false;
              }
              if (finished) break;
            }
            const GenerationResult& result = channel->result();
            if (result.finish_reason == "error") {
              send_event(dump(error_body(OpenAiError(500, "server_error", "", "", result.error))));
            } else {
              const json usage = usage_json(result, s.certificate);
              // The certificate reaches every stream: with include_usage in the usage chunk (as
              // OpenAI sends it), otherwise in the chunk that carries the finish reason.
              send_event(dump(completion_chunk(r, id, created, s.model_id, "", false,
                                               openai_finish_reason(result.finish_reason),
                                               r.include_usage ? json(nullptr) : usage)));
              if (r.include_usage) send_event(dump(usage_chunk(r, id, created, s.model_id, usage)));
            }
            send_event("[DONE]");
            sink.done();
            return true;
          },
          [&s, channel](bool success) {
            if (success) return;
            channel->request_cancel();
            s.scheduler->notify_cancel();
          });
    };
  };
  http.Post("/v1/completions", unless_refused(completion(false)));
  http.Post("/v1/chat/completions", unless_refused(completion(true)));
}

int serve_main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
      std::fputs(kServeUsage, stdout);
      return 0;
    }
  ServerOptions options;
  try {
    options = parse_server_options(argc, argv);
  } catch (const OptionError& e) {
    std::fprintf(stderr, "certkv serve: %s\n%s", e.what(), kServeUsage);
    return 2;
  }
  // SIGINT and SIGTERM go to sigwait below, in every thread; a write to a closed socket is an
  // error return, not a signal.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  HttpServer server(options);
  int port = 0;
  try {
    port = server.bind();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "certkv serve: %s\n", e.what());
    return 1;
  }
  std::thread listener([&] { server.listen(); });
  std::fprintf(stderr, "certkv serve: listening on http://%s:%d (loading %s)\n", options.host.c_str(), port,
               options.model_path.c_str());
  int status = 0;
  try {
    server.load();
    std::fprintf(stderr, "certkv serve: ready\n");
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    std::fprintf(stderr, "certkv serve: stopping (signal %d)\n", signal_number);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "certkv serve: %s\n", e.what());
    status = 1;
  }
  server.stop();
  listener.join();
  return status;
}

}  // namespace certkv::server
