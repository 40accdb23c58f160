// The HTTP server end to end: one server on 127.0.0.1 and a free port, shared by every test of
// this binary (SmolLM2, a lossy scheme so the meter has something to certify), driven with
// httplib's client.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "certkv/certkv.hpp"
#include "http_server.h"
#include "openai_protocol.h"
#include "test_paths.h"

namespace certkv::server {
namespace {

using nlohmann::json;

constexpr const char* kApiKey = "test-key";
constexpr int64_t kContextTokens = 256;
constexpr const char* kScheme = "fp8-e4m3";

ServerOptions test_options() {
  ServerOptions o;
  o.model_path = testing::smollm2_gguf();
  o.port = 0;
  o.parallel = 4;
  o.ctx_tokens = kContextTokens;
  o.kv = kScheme;
  o.api_key = kApiKey;
  o.threads = 2;
  return o;
}

// The server every test talks to, started once.
class ServerEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);
    server = std::make_unique<HttpServer>(test_options());
    port = server->bind();
    listener = std::thread([this] { server->listen(); });
    server->load();
  }
  void TearDown() override {
    server->stop();
    listener.join();
    server.reset();
  }
  std::unique_ptr<HttpServer> server;
  std::thread listener;
  int port = 0;
};

ServerEnvironment* g_env = nullptr;

httplib::Client client(const std::string& key = kApiKey) {
  httplib::Client c("127.0.0.1", g_env->port);
  if (!key.empty()) c.set_default_headers({{"Authorization", "Bearer " + key}});
  c.set_read_timeout(120, 0);
  return c;
}

struct Reply {
  int status = 0;
  json body;
};

// The status line's code of the first response to `request`, sent whole in one write on a new
// connection (so that a server refusing it after its headers still finds the body in its buffer,
// and no client is still writing when the answer comes); 0 when none came.
int raw_status(const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(g_env->port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0 &&
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) == ssize_t(request.size())) {
    char buf[512];
    ssize_t n = 0;
    while (reply.find("\r\n") == std::string::npos && (n = recv(fd, buf, sizeof buf, 0)) > 0) reply.append(buf, size_t(n));
  }
  close(fd);
  // "HTTP/1.1 411 Length Required\r\n"
  return reply.size() > 12 && reply.compare(0, 5, "HTTP/") == 0 ? std::atoi(reply.c_str() + 9) : 0;
}

// Everything the server sends back on one new connection for `parts`, sent one after another,
// each once the server has gone quiet for a second after the one before (so a part after a
// request's headers comes as a client that sends its body late sends it); ends when the server
// closes the connection.
std::string raw_exchange(const std::vector<std::string>& parts) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval timeout{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(g_env->port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
    for (const std::string& part : parts) {
      if (send(fd, part.data(), part.size(), MSG_NOSIGNAL) != ssize_t(part.size())) break;
      char buf[4096];
      ssize_t n = 0;
      while ((n = recv(fd, buf, sizeof buf, 0)) > 0) reply.append(buf, size_t(n));
      if (n == 0) break;  // closed by the server
    }
  }
  close(fd);
  return reply;
}

// How many responses `replies` holds (their status lines).
int count_responses(const std::string& replies) {
  int n = 0;
  for (size_t at = replies.find("HTTP/1.1 "); at != std::string::npos; at = replies.find("HTTP/1.1 ", at + 1)) ++n;
  return n;
}

Reply post(const std::string& path, const json& body, const std::string& key = kApiKey) {
  httplib::Client c = client(key);
  auto res = c.Post(path.c_str(), body.dump(), "application/json");
  EXPECT_TRUE(res) << "no response from " << path;
  if (!res) return {};
  return {res->status, json::parse(res->body)};
}

// The events of a server-sent-event stream (comments dropped); `framed` is false when an event
// is not a "data: " line ended by a blank line.
struct Stream {
  int status = 0;
  std::vector<std::string> events;
  bool framed = true;
};

Stream post_stream(const std::string& path, const json& body) {
  httplib::Client c = client();
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = {{"Authorization", std::string("Bearer ") + kApiKey}, {"Content-Type", "application/json"}};
  req.body = body.dump();
  std::string raw;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    raw.append(data, n);
    return true;
  };
  auto res = c.send(req);
  Stream s;
  EXPECT_TRUE(res);
  if (!res) return s;
  s.status = res->status;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t end = raw.find("\n\n", pos);
    if (end == std::string::npos) {
      s.framed = false;
      break;
    }
    const std::string block = raw.substr(pos, end - pos);
    pos = end + 2;
    if (block.rfind(":", 0) == 0) continue;  // a comment (keep-alive)
    if (block.rfind("data: ", 0) != 0 || block.find('\n') != std::string::npos) s.framed = false;
    s.events.push_back(block.substr(6));
  }
  return s;
}

json chat_body(const std::string& content, int max_tokens) {
  return json{{"model", "SmolLM2-135M-Instruct.Q4_1.gguf"},
              {"messages", json::array({json{{"role", "user"}, {"content", content}}})},
              {"max_tokens", max_tokens},
              {"temperature", 0}};
}

std::string metrics_text() {
  httplib::Client c = client();
  auto res = c.Get("/metrics");
  EXPECT_TRUE(res && res->status == 200);
  return res ? res->body : "";
}

// The value of one sample line of /metrics ("name{labels}" as printed), or -1.
double metric(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

void expect_certificate(const json& usage, int prompt_tokens, int completion_tokens) {
  EXPECT_EQ(usage.at("prompt_tokens").get<int>(), prompt_tokens);
  EXPECT_EQ(usage.at("completion_tokens").get<int>(), completion_tokens);
  EXPECT_EQ(usage.at("total_tokens").get<int>(), prompt_tokens + completion_tokens);
  const json& c = usage.at("certkv");
  EXPECT_EQ(c.at("scheme"), kScheme);
  EXPECT_EQ(c.at("meter_tier"), "A");
  ASSERT_TRUE(c.at("metered").get<bool>());
  const double meter_max = c.at("meter_max").get<double>(), meter_p99 = c.at("meter_p99").get<double>();
  EXPECT_GE(meter_max, 0.0);
  EXPECT_LE(meter_max, 1.0);
  EXPECT_LE(meter_p99, meter_max);
  EXPECT_GE(c.at("coverage").get<double>(), 0.0);
  EXPECT_LE(c.at("coverage").get<double>(), 1.0);
  EXPECT_EQ(c.at("tau").get<double>(), 0.2);
  EXPECT_EQ(c.at("gate_repairs").get<int64_t>(), 0);
  // SmolLM2: 30 layers x 9 query heads per decode step; the first token comes from the prefill.
  EXPECT_EQ(c.at("meter_cells").get<int64_t>(), int64_t(completion_tokens - 1) * 30 * 9);
  // Tokens in the cache: the prompt and every generated token but the last; a full block of 16
  // is quantized into lossy pages, the rest stays in bf16 tail pages.
  ASSERT_TRUE(c.at("kv_bytes").is_object());
  EXPECT_GT(c.at("kv_bytes").at("bf16").get<uint64_t>(), 0u);
  if (prompt_tokens + completion_tokens - 1 >= 16)
    EXPECT_GT(c.at("kv_bytes").at("lossy").get<uint64_t>(), 0u);
  else
    EXPECT_EQ(c.at("kv_bytes").at("lossy").get<uint64_t>(), 0u);
}

// The same request run on a certkv_engine directly, alone.
// What the engine alone generates for a prompt: the text, how it finished (in OpenAI's words)
// and how many tokens.
struct AloneResult {
  std::string text;
  std::string finish_reason;
  int tokens = 0;
};

AloneResult engine_alone_result(const std::vector<certkv_chat_message>& messages, const std::string& raw_prompt,
                                int max_tokens) {
  certkv::Model model(testing::smollm2_gguf());
  const std::string text = messages.empty() ? raw_prompt : model.chat(messages, true);
  const std::vector<int32_t> prompt = model.tokenize(text, true, true);
  certkv_engine_params p = certkv_engine_default_params();
  p.session.context_tokens = kContextTokens;
  p.session.n_threads = 2;
  p.session.kv = kScheme;
  p.max_sequences = 1;
  certkv_engine* engine = nullptr;
  certkv::check(certkv_engine_create(model.get(), &p, &engine));
  certkv_request_params r = certkv_request_default_params();
  r.prompt = prompt.data();
  r.n_prompt = int32_t(prompt.size());
  r.max_tokens = max_tokens;
  r.sampler.temperature = 0;
  int64_t id = 0;
  certkv::check(certkv_engine_submit(engine, &r, &id));
  certkv::check(certkv_engine_run(engine, nullptr, nullptr));
  certkv_request_result result;
  certkv::check(certkv_engine_result(engine, id, &result));
  AloneResult out{std::string(result.text, result.text_bytes), certkv::server::openai_finish_reason(result.finish_reason),
                  int(result.generated_tokens)};
  certkv_engine_free(engine);
  return out;
}

std::string engine_alone(const std::vector<certkv_chat_message>& messages, const std::string& raw_prompt,
                         int max_tokens) {
  return engine_alone_result(messages, raw_prompt, max_tokens).text;
}

TEST(Server, HealthAndModels) {
  httplib::Client c = client("");
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(json::parse(health->body).at("status"), "ok");
  auto models = client().Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  const json m = json::parse(models->body);
  EXPECT_EQ(m.at("object"), "list");
  EXPECT_EQ(m.at("data").at(0).at("id"), "SmolLM2-135M-Instruct.Q4_1.gguf");
}

TEST(Server, HealthIs503WhileLoadingAndAfterAFailedLoad) {
  ServerOptions o = test_options();
  o.model_path = testing::models_path("no-such-model.gguf");
  HttpServer loading(o);
  const int port = loading.bind();
  std::thread listener([&] { loading.listen(); });
  httplib::Client c("127.0.0.1", port);
  auto before = c.Get("/health");
  ASSERT_TRUE(before);
  EXPECT_EQ(before->status, 503);
  EXPECT_EQ(json::parse(before->body).at("status"), "loading");
  auto completion = c.Post("/v1/completions", {{"Authorization", std::string("Bearer ") + kApiKey}},
                           R"({"prompt": "hi"})", "application/json");
  ASSERT_TRUE(completion);
  EXPECT_EQ(completion->status, 503);
  EXPECT_THROW(loading.load(), std::runtime_error);
  auto after = c.Get("/health");
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 503);
  const json body = json::parse(after->body);
  EXPECT_EQ(body.at("status"), "error");
  EXPECT_NE(body.at("message").get<std::string>().find("no-such-model"), std::string::npos) << body.dump();
  loading.stop();
  listener.join();
}

// Regression: Debian's compiled cpp-httplib listens with a backlog of 5, and 64 streaming clients
// starting at once on a busy machine were reset (server_load). Bound but not yet accepting, the
// server's socket must let 64 connections complete, as they do with a backlog of 64 or more
// (with 5, the kernel completes 6 and drops the other SYNs).
TEST(Server, SixtyFourConnectionsQueueBeforeTheFirstAccept) {
  ServerOptions o = test_options();
  o.model_path = testing::models_path("no-such-model.gguf");
  HttpServer queued(o);
  const int port = queued.bind();
  constexpr int kClients = 64;
  std::vector<pollfd> clients;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < kClients; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address);
    ASSERT_TRUE(rc == 0 || errno == EINPROGRESS) << std::strerror(errno);
    clients.push_back(pollfd{fd, POLLOUT, 0});
  }
  // Completed handshakes are writable at once; a dropped SYN is retried only after a second.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  int connected = 0;
  for (pollfd& p : clients) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (poll(&p, 1, int(std::max<int64_t>(0, left.count()))) == 1 && (p.revents & POLLOUT)) {
      int error = 0;
      socklen_t n = sizeof error;
      getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &error, &n);
      connected += error == 0;
    }
  }
  for (pollfd& p : clients) close(p.fd);
  EXPECT_EQ(connected, kClients);
  std::thread listener([&] { queued.listen(); });
  auto health = httplib::Client("127.0.0.1", port).Get("/health");
  ASSERT_TRUE(health);  // listening: stop() ends it
  queued.stop();
  listener.join();
}

TEST(Server, ChatGreedyEqualsTheEngineAloneAndCarriesTheCertificate) {
  const Reply r = post("/v1/chat/completions", chat_body("What is the capital of France?", 8));
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.body.at("object"), "chat.completion");
  const json& choice = r.body.at("choices").at(0);
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  // The engine alone's text, finish reason and token count (the model may end its answer before 8).
  const AloneResult expected = engine_alone_result({{"user", "What is the capital of France?"}}, "", 8);
  EXPECT_EQ(choice.at("finish_reason"), expected.finish_reason);
  EXPECT_EQ(choice.at("message").at("content").get<std::string>(), expected.text);
  EXPECT_LE(expected.tokens, 8);
  certkv::Model model(testing::smollm2_gguf());
  const int prompt_tokens =
      int(model.tokenize(model.chat({{"user", "What is the capital of France?"}}, true), true, true).size());
  expect_certificate(r.body.at("usage"), prompt_tokens, expected.tokens);
}

TEST(Server, TheCertificatePerLayerOnRequest) {
  json body = chat_body("What is the capital of France?", 8);
  const Reply plain = post("/v1/chat/completions", body);
  ASSERT_EQ(plain.status, 200) << plain.body.dump();
  EXPECT_FALSE(plain.body.at("usage").at("certkv").contains("per_layer"));
  body["certkv"] = {{"per_layer", true}};
  const Reply r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  const json& c = r.body.at("usage").at("certkv");
  const json& layers = c.at("per_layer");
  ASSERT_EQ(layers.size(), 30u);
  // The layers partition the request's cells; its maximum is theirs.
  int64_t cells = 0;
  double meter_max = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_EQ(layers[i].at("layer").get<size_t>(), i);
    EXPECT_EQ(layers[i].at("meter_cells").get<int64_t>(), 7 * 9);
    EXPECT_LE(layers[i].at("meter_p99").get<double>(), layers[i].at("meter_max").get<double>());
    cells += layers[i].at("meter_cells").get<int64_t>();
    meter_max = std::max(meter_max, layers[i].at("meter_max").get<double>());
  }
  EXPECT_EQ(cells, c.at("meter_cells").get<int64_t>());
  EXPECT_EQ(meter_max, c.at("meter_max").get<double>());
  EXPECT_EQ(c.at("meter_max"), plain.body.at("usage").at("certkv").at("meter_max"));
}

TEST(Server, CompletionStreamsServerSentEventsEndingInDone) {
  const json body{{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}};
  const Reply whole = post("/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  EXPECT_EQ(whole.body.at("object"), "text_completion");
  const std::string text = whole.body.at("choices").at(0).at("text").get<std::string>();
  EXPECT_EQ(text, engine_alone({}, "Once upon a time", 6));

  json streamed_body = body;
  streamed_body["stream"] = true;
  streamed_body["stream_options"] = {{"include_usage", true}};
  const Stream s = post_stream("/v1/completions", streamed_body);
  ASSERT_EQ(s.status, 200);
  EXPECT_TRUE(s.framed);
  ASSERT_GE(s.events.size(), 3u);
  EXPECT_EQ(s.events.back(), "[DONE]");
  std::string joined;
  std::string finish;
  json usage;
  for (size_t i = 0; i + 1 < s.events.size(); ++i) {
    const json chunk = json::parse(s.events[i]);
    EXPECT_EQ(chunk.at("object"), "text_completion");
    if (chunk.at("choices").empty()) {
      EXPECT_EQ(i + 2, s.events.size()) << "the usage chunk comes last";
      usage = chunk.at("usage");
      continue;
    }
    EXPECT_FALSE(chunk.contains("usage"));
    joined += chunk.at("choices").at(0).at("text").get<std::string>();
    if (!chunk.at("choices").at(0).at("finish_reason").is_null())
      finish = chunk.at("choices").at(0).at("finish_reason");
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(finish, "length");
  ASSERT_TRUE(usage.is_object());
  expect_certificate(usage, 4, 6);
}

TEST(Server, ChatStreamWithoutIncludeUsageCarriesTheCertificateInTheFinishChunk) {
  json body = chat_body("Say hello.", 4);
  body["stream"] = true;
  const Stream s = post_stream("/v1/chat/completions", body);
  ASSERT_EQ(s.status, 200);
  EXPECT_TRUE(s.framed);
  ASSERT_GE(s.events.size(), 2u);
  EXPECT_EQ(s.events.back(), "[DONE]");
  const json first = json::parse(s.events.front());
  EXPECT_EQ(first.at("object"), "chat.completion.chunk");
  EXPECT_EQ(first.at("choices").at(0).at("delta").at("role"), "assistant");
  const json last = json::parse(s.events[s.events.size() - 2]);
  EXPECT_EQ(last.at("choices").at(0).at("finish_reason"), "length");
  ASSERT_TRUE(last.contains("usage"));
  EXPECT_EQ(last.at("usage").at("completion_tokens"), 4);
  EXPECT_TRUE(last.at("usage").at("certkv").at("metered").get<bool>());
}

TEST(Server, StopStringEndsTheTextBeforeIt) {
  const json body{{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}};
  const std::string text = post("/v1/completions", body).body.at("choices").at(0).at("text");
  ASSERT_GE(text.size(), 4u);
  const size_t cut = text.find(' ', 1);
  ASSERT_NE(cut, std::string::npos) << text;
  json stopped = body;
  stopped["stop"] = json::array({text.substr(cut, 3)});
  const Reply r = post("/v1/completions", stopped);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.body.at("choices").at(0).at("text"), text.substr(0, cut));
  EXPECT_EQ(r.body.at("choices").at(0).at("finish_reason"), "stop");
}

TEST(Server, ASeedReproducesASampledCompletion) {
  const json body{{"prompt", "The weather today"}, {"max_tokens", 6}, {"temperature", 0.9}, {"seed", 42}};
  const Reply a = post("/v1/completions", body);
  const Reply b = post("/v1/completions", body);
  ASSERT_EQ(a.status, 200);
  ASSERT_EQ(b.status, 200);
  EXPECT_EQ(a.body.at("choices").at(0).at("text"), b.body.at("choices").at(0).at("text"));
  // Any 64-bit seed: -1 and 2^64 - 1 are the same bits, so the same stream.
  json negative = body, top = body;
  negative["seed"] = -1;
  top["seed"] = std::numeric_limits<uint64_t>::max();
  const Reply c = post("/v1/completions", negative);
  const Reply d = post("/v1/completions", top);
  ASSERT_EQ(c.status, 200) << c.body.dump();
  ASSERT_EQ(d.status, 200) << d.body.dump();
  EXPECT_EQ(c.body.at("choices").at(0).at("text"), d.body.at("choices").at(0).at("text"));
}

TEST(Server, ConcurrentRequestsGetTheirOutputsAlone) {
  const std::vector<std::string> prompts = {"Name a color.", "Count to three.", "What is a cat?", "Say yes."};
  std::vector<std::string> alone;
  for (const std::string& p : prompts)
    alone.push_back(post("/v1/chat/completions", chat_body(p, 5)).body.at("choices").at(0).at("message").at("content"));
  std::vector<Reply> together(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i)
    threads.emplace_back([&, i] { together[i] = post("/v1/chat/completions", chat_body(prompts[i], 5)); });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(together[i].status, 200) << together[i].body.dump();
    EXPECT_EQ(together[i].body.at("choices").at(0).at("message").at("content"), alone[i]) << prompts[i];
  }
}

TEST(Server, ATooLongPromptFailsAloneWhileAnotherCompletes) {
  Reply ok;
  std::thread other([&] { ok = post("/v1/chat/completions", chat_body("Tell me a story.", 12)); });
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += "word ";
  const Reply too_long = post("/v1/completions", json{{"prompt", long_prompt}, {"max_tokens", 4}});
  EXPECT_EQ(too_long.status, 400);
  EXPECT_EQ(too_long.body.at("error").at("code"), "context_length_exceeded") << too_long.body.dump();
  EXPECT_EQ(too_long.body.at("error").at("param"), "prompt");
  // A prompt that fits, with more output than the context leaves: refused by the engine.
  const Reply too_much = post("/v1/completions", json{{"prompt", "Hello"}, {"max_tokens", kContextTokens}});
  EXPECT_EQ(too_much.status, 400);
  EXPECT_EQ(too_much.body.at("error").at("code"), "context_length_exceeded") << too_much.body.dump();
  other.join();
  ASSERT_EQ(ok.status, 200) << ok.body.dump();
  EXPECT_EQ(ok.body.at("usage").at("completion_tokens"), 12);
}

TEST(Server, ADisconnectedStreamIsCancelledAndFreed) {
  const std::string before = metrics_text();
  const double cancelled_before = std::max(0.0, metric(before, "certkv:requests_finished_total{reason=\"cancelled\"}"));
  const double generated_before = metric(before, "certkv:generation_tokens_total");
  httplib::Client c = client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Authorization", std::string("Bearer ") + kApiKey}, {"Content-Type", "application/json"}};
  req.body = json{{"prompt", "A long story:"}, {"max_tokens", 200}, {"temperature", 0}, {"stream", true},
                  {"stream_options", {{"include_usage", true}}}}.dump();
  int data_events = 0;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const std::string chunk(data, n);
    for (size_t at = chunk.find("data: "); at != std::string::npos; at = chunk.find("data: ", at + 1)) ++data_events;
    return data_events < 2;  // hang up after two events
  };
  c.send(req);
  c.stop();
  EXPECT_GE(data_events, 2);
  // The server notices at its next write, cancels the request and frees its pages.
  double cancelled = cancelled_before;
  std::string text;
  for (int i = 0; i < 200 && cancelled <= cancelled_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    text = metrics_text();
    cancelled = metric(text, "certkv:requests_finished_total{reason=\"cancelled\"}");
  }
  EXPECT_EQ(cancelled, cancelled_before + 1) << text;
  EXPECT_EQ(metric(text, "certkv:requests_running"), 0);
  EXPECT_EQ(metric(text, "certkv:requests_waiting"), 0);
  // It stopped well before its 200 tokens.
  EXPECT_LT(metric(text, "certkv:generation_tokens_total") - generated_before, 200) << text;
}

TEST(Server, AClientGoneBeforeItsWholeAnswerIsCancelled) {
  const std::string before = metrics_text();
  const double cancelled_before = std::max(0.0, metric(before, "certkv:requests_finished_total{reason=\"cancelled\"}"));
  const double generated_before = metric(before, "certkv:generation_tokens_total");
  httplib::Client c = client();
  c.set_read_timeout(0, 300000);  // gives up after 0.3 s and closes the connection
  auto res = c.Post("/v1/completions", json{{"prompt", "A long story:"}, {"max_tokens", 200}, {"temperature", 0}}.dump(),
                    "application/json");
  EXPECT_FALSE(res);
  c.stop();
  double cancelled = cancelled_before;
  std::string text;
  for (int i = 0; i < 200 && cancelled <= cancelled_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    text = metrics_text();
    cancelled = metric(text, "certkv:requests_finished_total{reason=\"cancelled\"}");
  }
  EXPECT_EQ(cancelled, cancelled_before + 1) << text;
  EXPECT_EQ(metric(text, "certkv:requests_running"), 0);
  EXPECT_LT(metric(text, "certkv:generation_tokens_total") - generated_before, 200) << text;
}

// A connection to 127.0.0.1:port, or -1.
int connect_local(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server has closed fd (end of stream, or an error on it) within `wait`; what it
// sent before goes to `received`.
bool closed_by_server(int fd, std::chrono::milliseconds wait, std::string* received = nullptr) {
  const auto until = std::chrono::steady_clock::now() + wait;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, int(left.count())) <= 0) return false;
    char buf[512];
    const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return true;
    if (received) received->append(buf, size_t(n));
  }
}

// A server of its own for a test, listening until the test ends (an ASSERT included).
struct OwnServer {
  explicit OwnServer(const ServerOptions& o) : server(o), port(server.bind()), listener([this] { server.listen(); }) {}
  ~OwnServer() {
    server.stop();
    listener.join();
  }
  HttpServer server;
  int port;
  std::thread listener;
};

// One whole HTTP response read from fd (its headers, then a Content-Length body or chunks up to
// the last), or what came before `wait` ran out or the server closed.
std::string read_response(int fd, std::chrono::milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  std::string r;
  auto complete = [&r] {
    const size_t head_end = r.find("\r\n\r\n");
    if (head_end == std::string::npos) return false;
    const size_t length_at = r.find("Content-Length: ");
    if (length_at != std::string::npos && length_at < head_end)
      return r.size() >= head_end + 4 + std::stoull(r.substr(length_at + 16));
    return r.find("\r\n0\r\n\r\n", head_end) != std::string::npos;
  };
  while (!complete()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, int(left.count())) <= 0) break;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    r.append(buf, size_t(n));
  }
  return r;
}

// A slowloris: clients that send a header line now and then, each within the socket's read
// timeout, and never end their request's head. Four of them against two HTTP threads held both
// threads for as long as they kept sending; each is now closed at the request timeout, and a
// request behind them is answered.
TEST(Server, SlowClientsAreClosedAtTheRequestTimeout) {
  ServerOptions o = test_options();
  o.model_path = testing::models_path("no-such-model.gguf");  // /health answers 503 (loading)
  o.http_threads = 2;
  o.request_timeout_seconds = 1;
  OwnServer guarded(o);
  constexpr int kSlow = 4;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {  // connected before the request below, in this order
    fds.push_back(connect_local(guarded.port));
    ASSERT_GE(fds.back(), 0);
    const std::string line = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    ASSERT_EQ(send(fds.back(), line.data(), line.size(), MSG_NOSIGNAL), ssize_t(line.size()));
  }
  std::atomic<int> closed{0};
  std::vector<std::thread> slow;
  for (int fd : fds)
    slow.emplace_back([fd, &closed] {
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - start < std::chrono::seconds(8)) {
        if (closed_by_server(fd, std::chrono::milliseconds(300)) || send(fd, "X-Slow: 1\r\n", 11, MSG_NOSIGNAL) < 0) {
          ++closed;
          break;
        }
      }
      close(fd);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the slow clients hold both threads
  httplib::Client c("127.0.0.1", guarded.port);
  c.set_read_timeout(20, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto health = c.Get("/health");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::thread& t : slow) t.join();
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  // Two rounds of two slow clients, a second each; without the deadlines, the 8 s they keep sending.
  EXPECT_LT(waited, 5.0);
  EXPECT_EQ(closed.load(), kSlow);
}

// The deadlines bound what clients send, not what the server does: with a 0.5 s request timeout,
// completions that take longer (streamed or not) come whole, one after another on one raw
// kept-alive connection; a body that does not come, a body trickled a byte at a time and a
// connection that sends nothing are closed, and counted on /metrics.
TEST(Server, TheRequestTimeoutLeavesTheServersOwnTimeAlone) {
  ServerOptions o = test_options();
  o.api_key.clear();
  o.request_timeout_seconds = 0.5;
  OwnServer quick(o);
  quick.server.load();
  const int fd = connect_local(quick.port);
  ASSERT_GE(fd, 0);
  auto post = [](const json& body) {
    const std::string text = body.dump();
    return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
           std::to_string(text.size()) + "\r\n\r\n" + text;
  };
  const json body{{"prompt", "A long story:"}, {"max_tokens", 240}, {"temperature", 0}, {"ignore_eos", true}};
  json streamed = body;
  streamed["stream"] = true;
  for (const json& b : {body, streamed}) {
    const std::string request = post(b);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
    const std::string response = read_response(fd, std::chrono::seconds(60));
    ASSERT_EQ(response.compare(0, 15, "HTTP/1.1 200 OK"), 0) << response;
    if (b.contains("stream")) {
      EXPECT_NE(response.find("data: [DONE]"), std::string::npos) << response;
    } else {
      EXPECT_NE(response.find("\"completion_tokens\":240"), std::string::npos) << response;
    }
    // Longer than the timeout, or the case shows nothing.
    EXPECT_GT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  }
  const std::string health = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  ASSERT_EQ(send(fd, health.data(), health.size(), MSG_NOSIGNAL), ssize_t(health.size()));
  EXPECT_EQ(read_response(fd, std::chrono::seconds(10)).compare(0, 15, "HTTP/1.1 200 OK"), 0);
  close(fd);
  // Headers promising a body that does not come, and a large body trickled a byte every 0.1 s
  // (its Content-Length would buy it 8.5 s; what it sends buys one timeout): each connection is
  // closed, after httplib's 400 for the unread body, so a body arriving late is never read as a
  // request.
  for (const uint64_t length : {uint64_t(20), uint64_t(1) << 20}) {
    const int late = connect_local(quick.port);
    ASSERT_GE(late, 0);
    const std::string head = "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             "Content-Length: " + std::to_string(length) + "\r\n\r\n";
    ASSERT_EQ(send(late, head.data(), head.size(), MSG_NOSIGNAL), ssize_t(head.size()));
    const auto start = std::chrono::steady_clock::now();
    std::string answer;
    bool closed = false;
    while (!closed && std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
      closed = closed_by_server(late, std::chrono::milliseconds(100), &answer);
      if (!closed && length > 20) send(late, "{", 1, MSG_NOSIGNAL);
    }
    EXPECT_TRUE(closed) << length;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3)) << length;
    EXPECT_EQ(answer.find("200 OK"), std::string::npos) << answer;
    close(late);
  }
  // A connection that sends nothing is closed at the head's deadline, well before httplib's 5 s
  // keep-alive wait.
  const int idle = connect_local(quick.port);
  ASSERT_GE(idle, 0);
  const auto idle_start = std::chrono::steady_clock::now();
  EXPECT_TRUE(closed_by_server(idle, std::chrono::milliseconds(3000)));
  EXPECT_LT(std::chrono::steady_clock::now() - idle_start, std::chrono::seconds(2));
  close(idle);
  httplib::Client c("127.0.0.1", quick.port);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metric(metrics->body, "certkv:http_connections_timed_out_total"), 3) << metrics->body;
}

TEST(Server, ApiKeyIsRequiredExceptForHealth) {
  const json body{{"prompt", "hi"}, {"max_tokens", 1}};
  const Reply missing = post("/v1/completions", body, "");
  EXPECT_EQ(missing.status, 401);
  EXPECT_EQ(missing.body.at("error").at("code"), "invalid_api_key");
  EXPECT_EQ(post("/v1/completions", body, "wrong").status, 401);
  auto metrics = client("wrong").Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 401);
  auto health = client("").Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// GET / is the dashboard page as built from server/dashboard.html, open without the key; its
// numbers need the key, and after a chat hold the chat's decode steps, per (layer, query head)
// exactly the meters the chat's own certificate reports per layer.
TEST(Server, DashboardPageAndItsState) {
  auto page = client("").Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  std::ifstream file(std::string(CERTKV_SOURCE_DIR) + "/server/dashboard.html", std::ios::binary);
  const std::string html((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(html.empty());
  EXPECT_EQ(page->body, html);
  auto refused = client("").Get("/dashboard/state");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);

  auto state = [] {
    auto res = client().Get("/dashboard/state");
    EXPECT_TRUE(res && res->status == 200);
    return res ? json::parse(res->body) : json();
  };
  const json before = state();
  EXPECT_EQ(before.at("scheme"), kScheme);
  EXPECT_EQ(before.at("meter_tier"), "A");
  EXPECT_GT(before.at("kv").at("capacity_pages").get<uint64_t>(), 0u);
  const json& meter_before = before.at("meter");
  EXPECT_TRUE(meter_before.at("metered").get<bool>());
  EXPECT_EQ(meter_before.at("n_layers"), 30);
  EXPECT_EQ(meter_before.at("n_heads"), 9);
  const int64_t last_before =
      meter_before.at("steps").empty() ? 0 : meter_before.at("steps").back().at("step").get<int64_t>();

  json body = chat_body("Name a colour.", 6);
  body["certkv"] = {{"per_layer", true}};
  const Reply r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  const json after = state();
  EXPECT_EQ(after.at("requests").at("finished").get<uint64_t>(),
            before.at("requests").at("finished").get<uint64_t>() + 1);
  EXPECT_EQ(after.at("requests").at("running"), 0);
  std::vector<double> layer_max(30, 0.0);
  int chat_steps = 0;
  for (const json& step : after.at("meter").at("steps")) {
    if (step.at("step").get<int64_t>() <= last_before) continue;
    ++chat_steps;
    EXPECT_EQ(step.at("cells"), 30 * 9);  // the chat alone
    const json& meters = step.at("meters");
    ASSERT_EQ(meters.size(), 30u);
    for (size_t l = 0; l < 30; ++l) {
      ASSERT_EQ(meters[l].size(), 9u);
      for (const json& m : meters[l]) {
        ASSERT_TRUE(m.is_number()) << "layer " << l;
        EXPECT_GE(m.get<double>(), 0.0);
        EXPECT_LE(m.get<double>(), 1.0);
        layer_max[l] = std::max(layer_max[l], m.get<double>());
      }
    }
  }
  EXPECT_EQ(chat_steps, 5);  // 6 tokens, the first from the prefill
  const json& layers = r.body.at("usage").at("certkv").at("per_layer");
  ASSERT_EQ(layers.size(), 30u);
  for (size_t l = 0; l < 30; ++l)
    EXPECT_EQ(float(layer_max[l]), float(layers[l].at("meter_max").get<double>())) << "layer " << l;
}

TEST(Server, BadInputGetsOpenAiErrorsNamingTheField) {
  httplib::Client c = client();
  auto bad_json = c.Post("/v1/chat/completions", "{\"messages\": [", "application/json");
  ASSERT_TRUE(bad_json);
  EXPECT_EQ(bad_json->status, 400);
  EXPECT_EQ(json::parse(bad_json->body).at("error").at("code"), "invalid_json");
  auto field = [](const Reply& r) { return r.body.at("error").at("param").get<std::string>(); };
  json temp = chat_body("hi", 1);
  temp["temperature"] = "hot";
  Reply r = post("/v1/chat/completions", temp);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(field(r), "temperature");
  r = post("/v1/chat/completions", json{{"max_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(field(r), "messages");
  json role = chat_body("hi", 1);
  role["messages"][0]["role"] = "wizard";
  r = post("/v1/chat/completions", role);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(field(r), "messages[0].role");
  json per_layer = chat_body("hi", 1);
  per_layer["certkv"] = {{"per_layer", "yes"}};
  r = post("/v1/chat/completions", per_layer);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(field(r), "certkv.per_layer");
  json unknown_model = chat_body("hi", 1);
  unknown_model["model"] = "gpt-4";
  r = post("/v1/chat/completions", unknown_model);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.body.at("error").at("code"), "model_not_found");
  auto no_route = c.Get("/v1/nothing");
  ASSERT_TRUE(no_route);
  EXPECT_EQ(no_route->status, 404);
  EXPECT_TRUE(json::parse(no_route->body).at("error").is_object());
  auto big = c.Post("/v1/completions", std::string(size_t(2) << 20, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_EQ(json::parse(big->body).at("error").at("code"), "request_too_large");
  // A body the limit cannot see (chunked, with a Content-Length beside it or not, or without any
  // length, or compressed) is refused before it is read.
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                           std::string(kApiKey) + "\r\nContent-Type: application/json\r\n";
  const std::string chunk = "10\r\n{\"prompt\": \"hi\"}\r\n0\r\n\r\n";
  EXPECT_EQ(raw_status(head + "Transfer-Encoding: chunked\r\n\r\n" + chunk), 411);
  EXPECT_EQ(raw_status(head + "Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n" + chunk), 411);
  EXPECT_EQ(raw_status(head + "Connection: close\r\n\r\n{\"prompt\": \"hi\"}"), 411);
  {
    httplib::Client chunked = client();  // the body the refusal names, through a client
    auto res = chunked.Post("/v1/completions", httplib::Headers{{"Transfer-Encoding", "chunked"}}, "{}",
                            "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 411);
    EXPECT_EQ(json::parse(res->body).at("error").at("code"), "length_required");
  }
  {
    httplib::Client gz = client();
    auto res = gz.Post("/v1/completions", httplib::Headers{{"Content-Encoding", "gzip"}}, "not really gzip",
                       "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 415);
    EXPECT_EQ(json::parse(res->body).at("error").at("code"), "unsupported_content_encoding");
  }
  // A number past double's range is not JSON the server can read: 400, not 500.
  auto huge = c.Post("/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 1e999}",
                     "application/json");
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 400);
  EXPECT_EQ(json::parse(huge->body).at("error").at("code"), "invalid_json");
  // A chat body with one value set (a JSON pointer) is refused with 400 naming `param`.
  auto refused = [&](const std::string& pointer, const json& value, const std::string& param) {
    json body = chat_body("hi", 1);
    body[json::json_pointer(pointer)] = value;
    const Reply reply = post("/v1/chat/completions", body);
    EXPECT_EQ(reply.status, 400) << pointer;
    EXPECT_EQ(field(reply), param) << pointer;
  };
  refused("/messages/0/content", json::array({{{"type", 1}, {"text", "x"}}}), "messages[0].content[0]");
  // A NUL would cut the text where the engine reads it as a C string.
  refused("/messages/0/content", std::string("What is 2+2?") + '\0' + " and the rest", "messages[0].content");
  refused("/stop", std::string("e") + '\0' + "zzz", "stop");
  // Fields that would change the answer are refused unless neutral.
  refused("/frequency_penalty", 0.5, "frequency_penalty");
  refused("/tool_choice", "required", "tool_choice");
  json neutral = chat_body("hi", 1);
  neutral["frequency_penalty"] = 0;
  neutral["presence_penalty"] = 0.0;
  neutral["logit_bias"] = json::object();
  neutral["response_format"] = {{"type", "text"}};
  r = post("/v1/chat/completions", neutral);
  EXPECT_EQ(r.status, 200) << r.body.dump();
}

// The status code of the first response in `replies`, 0 when there is none.
int first_status(const std::string& replies) {
  return replies.size() > 12 && replies.compare(0, 9, "HTTP/1.1 ") == 0 ? std::atoi(replies.c_str() + 9) : 0;
}

// No request body is ever parsed as a request. A body httplib would not read or could not bound
// (chunked, compressed, on a GET) is refused from the headers and the connection closed after the
// answer; a refused request with a Content-Length (wrong key) has its body read first, so what
// follows it on the connection is the next request. Here a well-formed request with the right key
// is sent as the body, a second after the headers, as a client sending its body late sends it.
TEST(Server, ARefusedRequestsBodyIsNeverReadAsTheNextRequest) {
  const std::string key = "Authorization: Bearer " + std::string(kApiKey) + "\r\n";
  const std::string smuggled = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key + "\r\n";
  const std::string length = "Content-Length: " + std::to_string(smuggled.size()) + "\r\n";
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n";
  struct Case {
    std::string headers;
    int status;
  };
  const Case closing[] = {
      {head + key + "Content-Encoding: gzip\r\n" + length + "\r\n", 415},
      {head + key + "Transfer-Encoding: chunked\r\n\r\n", 411},
      {head + key + "\r\n", 411},
      {"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key + length + "\r\n", 400},
      // A Range header does not cut or stretch an error body.
      {head + key + "Range: bytes=0-100000\r\nTransfer-Encoding: chunked\r\n\r\n", 411},
      {head + key + "Range: bytes=1000-\r\nTransfer-Encoding: chunked\r\n\r\n", 411},
  };
  // A Range httplib cannot parse: it answers 416 from the headers, before the routes, and the
  // connection closes with the body unread.
  const std::string bad_range = raw_exchange({head + key + "Range: bytes=abc\r\n" + length + "\r\n", smuggled});
  EXPECT_EQ(first_status(bad_range), 416) << bad_range;
  EXPECT_EQ(count_responses(bad_range), 1) << bad_range;
  for (const Case& c : closing) {
    const std::string replies = raw_exchange({c.headers, smuggled});
    EXPECT_EQ(first_status(replies), c.status) << replies;
    EXPECT_EQ(count_responses(replies), 1) << replies;
    EXPECT_NE(replies.find("Connection: close"), std::string::npos) << replies;
    EXPECT_NE(replies.find("\"error\""), std::string::npos) << replies;
    EXPECT_LT(replies.size(), 1000u) << replies;  // the error alone, whatever the Range
  }
  // HEAD with a body: refused, and its connection closed although its answer has no body to fail.
  const std::string head_replies =
      raw_exchange({"HEAD /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key + length + "\r\n", smuggled});
  EXPECT_EQ(first_status(head_replies), 400) << head_replies;
  EXPECT_EQ(count_responses(head_replies), 1) << head_replies;
  EXPECT_NE(head_replies.find("Connection: close"), std::string::npos) << head_replies;
  // A wrong key: the late body is read as the body; the connection stays open for the next request.
  const std::string models = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key + "\r\n";
  const std::string wrong = head + "Authorization: Bearer wrong\r\n" + length + "\r\n";
  std::string replies = raw_exchange({wrong, smuggled, models});
  EXPECT_EQ(first_status(replies), 401) << replies;
  EXPECT_EQ(count_responses(replies), 2) << replies;
  EXPECT_EQ(replies.find("Connection: close"), std::string::npos) << replies;
  // The same with the body sent at once, as clients send it, and a wrong key on an unknown path.
  replies = raw_exchange({wrong + smuggled, models});
  EXPECT_EQ(first_status(replies), 401) << replies;
  EXPECT_EQ(count_responses(replies), 2) << replies;
  const std::string nowhere = "POST /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n" + length;
  replies = raw_exchange({nowhere + "\r\n" + smuggled, models});
  EXPECT_EQ(first_status(replies), 401) << replies;
  EXPECT_EQ(count_responses(replies), 2) << replies;
  // Two requests on one kept-alive connection are both answered: the checks above are not passing
  // because the server never reads a second request.
  EXPECT_EQ(count_responses(raw_exchange({smuggled, smuggled})), 2);
  EXPECT_EQ(client().Get("/health")->status, 200);
}

TEST(Server, TokenizeAndDetokenizeRoundTrip) {
  const std::string text = "Hello, world! Caf\xc3\xa9 42.";
  const Reply t = post("/tokenize", json{{"content", text}});
  ASSERT_EQ(t.status, 200) << t.body.dump();
  const std::vector<int32_t> tokens = t.body.at("tokens").get<std::vector<int32_t>>();
  ASSERT_FALSE(tokens.empty());
  certkv::Model model(testing::smollm2_gguf());
  EXPECT_EQ(tokens, model.tokenize(text, false, true));
  const Reply d = post("/detokenize", json{{"tokens", tokens}});
  ASSERT_EQ(d.status, 200);
  EXPECT_EQ(d.body.at("content"), text);
  const Reply bad = post("/detokenize", json{{"tokens", {1, -5}}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.body.at("error").at("param"), "tokens[1]");
  // Control tokens come back as the text /tokenize read them from (llama-server's behaviour), or
  // not at all when render_special is false.
  const std::string turn = "<|im_start|>user\nHi<|im_end|>";
  const std::vector<int32_t> turn_tokens = post("/tokenize", json{{"content", turn}}).body.at("tokens").get<std::vector<int32_t>>();
  ASSERT_EQ(turn_tokens.size(), model.tokenize(turn, false, true).size());
  EXPECT_LT(turn_tokens.size(), model.tokenize(turn, false, false).size());  // the markers are single tokens
  EXPECT_EQ(post("/detokenize", json{{"tokens", turn_tokens}}).body.at("content"), turn);
  EXPECT_EQ(post("/detokenize", json{{"tokens", turn_tokens}, {"render_special", false}}).body.at("content"), "user\nHi");
  const Reply flag = post("/detokenize", json{{"tokens", turn_tokens}, {"render_special", "yes"}});
  EXPECT_EQ(flag.status, 400);
  EXPECT_EQ(flag.body.at("error").at("param"), "render_special");
}

// Log-probabilities in OpenAI's shapes: completions (logprobs N, with echo the prompt's first,
// max_tokens 0 for the prompt alone: what evaluation harnesses send) and chat (logprobs with
// top_logprobs); the values are the log-softmax of the model's logits (the engine's test holds them
// to a session's), so greedy tokens are their positions' most likely and probabilities are <= 1.
TEST(Server, LogprobsAndEchoInOpenAisShapes) {
  const std::string prompt = "The cat sat on the";
  const Reply plain = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0},
                                                   {"logprobs", 2}, {"ignore_eos", true}});
  ASSERT_EQ(plain.status, 200) << plain.body.dump();
  const json& lp = plain.body.at("choices").at(0).at("logprobs");
  ASSERT_EQ(lp.at("tokens").size(), 4u) << lp.dump();
  std::string joined;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(lp.at("text_offset").at(i), joined.size());
    joined += lp.at("tokens").at(i).get<std::string>();
    const double logprob = lp.at("token_logprobs").at(i).get<double>();
    EXPECT_LE(logprob, 0.0);
    const json& top = lp.at("top_logprobs").at(i);
    ASSERT_GE(top.size(), 1u);
    EXPECT_LE(top.size(), 2u);
    // Greedy: the token is the most likely one, its logprob the largest of the top.
    double best = -1e300;
    for (const auto& [text, value] : top.items()) best = std::max(best, value.get<double>());
    EXPECT_DOUBLE_EQ(best, logprob) << top.dump();
    EXPECT_TRUE(top.contains(lp.at("tokens").at(i).get<std::string>())) << top.dump();
  }
  EXPECT_EQ(joined, plain.body.at("choices").at(0).at("text"));

  // echo with max_tokens 0: the prompt alone, each token after the first with its logprob.
  const Reply echo = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 0}, {"temperature", 0},
                                                  {"logprobs", 1}, {"echo", true}});
  ASSERT_EQ(echo.status, 200) << echo.body.dump();
  const json& c = echo.body.at("choices").at(0);
  EXPECT_EQ(c.at("text"), prompt);
  EXPECT_EQ(c.at("finish_reason"), "length");
  const json& e = c.at("logprobs");
  certkv::Model model(testing::smollm2_gguf());
  const std::vector<int32_t> ids = model.tokenize(prompt, true, true);
  ASSERT_EQ(e.at("tokens").size(), ids.size()) << e.dump();
  EXPECT_TRUE(e.at("token_logprobs").at(0).is_null());
  EXPECT_TRUE(e.at("top_logprobs").at(0).is_null());
  for (size_t i = 1; i < ids.size(); ++i) {
    EXPECT_EQ(e.at("tokens").at(i), model.piece(ids[i]));
    EXPECT_LE(e.at("token_logprobs").at(i).get<double>(), 0.0);
    EXPECT_EQ(e.at("top_logprobs").at(i).size(), 1u);
  }
  EXPECT_EQ(echo.body.at("usage").at("completion_tokens"), 0);
  // The prompt as lm-evaluation-harness sends it (a list of one list of ids) gives the same answer.
  const Reply nested = post("/v1/completions", json{{"prompt", json::array({ids})}, {"max_tokens", 0}, {"temperature", 0},
                                                    {"logprobs", 1}, {"echo", true}});
  ASSERT_EQ(nested.status, 200) << nested.body.dump();
  EXPECT_EQ(nested.body.at("choices").at(0).at("logprobs"), e);
  // With a generated token the echoed prompt's logprobs come first, then the token's.
  const Reply echo1 = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0},
                                                   {"logprobs", 0}, {"echo", true}});
  ASSERT_EQ(echo1.status, 200);
  const json& e1 = echo1.body.at("choices").at(0).at("logprobs");
  ASSERT_EQ(e1.at("tokens").size(), ids.size() + 1);
  EXPECT_EQ(e1.at("token_logprobs").at(ids.size() - 1), e.at("token_logprobs").at(ids.size() - 1));
  EXPECT_EQ(e1.at("tokens").at(ids.size()), lp.at("tokens").at(0));  // greedy: the same first token
  EXPECT_EQ(e1.at("token_logprobs").at(ids.size()), lp.at("token_logprobs").at(0));
  // A piece that cuts a UTF-8 character is written as its bytes' escapes, as vLLM writes it.
  const Reply cut = post("/v1/completions", json{{"prompt", "\xe6\x88\x91\xe5\x96\x9c"}, {"max_tokens", 1},
                                                 {"temperature", 0}, {"logprobs", 1}, {"echo", true}});
  ASSERT_EQ(cut.status, 200) << cut.body.dump();
  EXPECT_EQ(cut.body.at("choices").at(0).at("logprobs").at("tokens").at(0), "bytes:\\xe6\\x88");
  // text_offset indexes the returned text, prompt included.
  const std::string echoed = echo1.body.at("choices").at(0).at("text").get<std::string>();
  for (size_t i = 0; i < e1.at("tokens").size(); ++i) {
    const std::string token = e1.at("tokens").at(i).get<std::string>();
    EXPECT_EQ(echoed.substr(e1.at("text_offset").at(i).get<size_t>(), token.size()), token) << i;
  }

  // Chat: logprobs true with top_logprobs; an end of generation that ends the answer has no entry,
  // so the entries' texts are the message.
  const Reply chat = post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                                                       {"max_tokens", 48}, {"temperature", 0}, {"logprobs", true},
                                                       {"top_logprobs", 2}});
  ASSERT_EQ(chat.status, 200) << chat.body.dump();
  const json& content = chat.body.at("choices").at(0).at("logprobs").at("content");
  ASSERT_GE(content.size(), 1u);
  const bool ended = chat.body.at("choices").at(0).at("finish_reason") == "stop";
  EXPECT_EQ(content.size() + (ended ? 1 : 0), chat.body.at("usage").at("completion_tokens").get<size_t>());
  std::string message;
  for (const json& t : content) message += t.at("token").get<std::string>();
  EXPECT_EQ(message, chat.body.at("choices").at(0).at("message").at("content"));
  for (const json& t : content) {
    EXPECT_LE(t.at("logprob").get<double>(), 0.0);
    std::string bytes;
    for (const json& b : t.at("bytes")) bytes += char(b.get<int>());
    EXPECT_EQ(bytes, t.at("token").get<std::string>());
    ASSERT_EQ(t.at("top_logprobs").size(), 2u);
    EXPECT_EQ(t.at("top_logprobs").at(0).at("logprob"), t.at("logprob"));  // greedy
  }
  // Streamed: the chunks' logprobs, joined, are the whole answer's.
  const Stream streamed = post_stream("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0},
                                                             {"logprobs", 2}, {"ignore_eos", true}, {"stream", true}});
  ASSERT_EQ(streamed.status, 200);
  json joined_tokens = json::array(), joined_logprobs = json::array(), joined_offsets = json::array();
  for (size_t i = 0; i + 1 < streamed.events.size(); ++i) {
    const json chunk = json::parse(streamed.events[i]);
    const json& l = chunk.at("choices").at(0).at("logprobs");
    if (l.is_null()) continue;
    for (size_t k = 0; k < l.at("tokens").size(); ++k) {
      joined_tokens.push_back(l.at("tokens").at(k));
      joined_logprobs.push_back(l.at("token_logprobs").at(k));
      joined_offsets.push_back(l.at("text_offset").at(k));
    }
  }
  EXPECT_EQ(joined_tokens, lp.at("tokens"));
  EXPECT_EQ(joined_logprobs, lp.at("token_logprobs"));
  EXPECT_EQ(joined_offsets, lp.at("text_offset"));
  const Stream chat_streamed =
      post_stream("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 48},
                                              {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2}, {"stream", true}});
  ASSERT_EQ(chat_streamed.status, 200);
  json joined_content = json::array();
  for (size_t i = 0; i + 1 < chat_streamed.events.size(); ++i) {
    const json chunk = json::parse(chat_streamed.events[i]);
    if (chunk.at("choices").empty()) continue;
    const json& l = chunk.at("choices").at(0).at("logprobs");
    if (!l.is_null())
      for (const json& t : l.at("content")) joined_content.push_back(t);
  }
  EXPECT_EQ(joined_content, content);
  // Bad values, and what is not served yet.
  auto bad = [](const json& body, bool chat_endpoint, const std::string& param) {
    const Reply r = post(chat_endpoint ? "/v1/chat/completions" : "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << body.dump();
    EXPECT_EQ(r.body.at("error").at("param"), param) << r.body.dump();
  };
  bad(json{{"prompt", "a"}, {"logprobs", 21}}, false, "logprobs");
  bad(json{{"prompt", "a"}, {"top_logprobs", 2}}, false, "top_logprobs");  // chat's field
  bad(json{{"prompt", json::array({json::array()})}}, false, "prompt");
  // Neutral values are taken: logprobs false (completions), top_logprobs 0 without logprobs (chat).
  EXPECT_EQ(post("/v1/completions", json{{"prompt", "a"}, {"max_tokens", 1}, {"logprobs", false}}).status, 200);
  EXPECT_EQ(post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 1},
                                              {"top_logprobs", 0}}).status, 200);
  bad(json{{"prompt", "a"}, {"logprobs", true}}, false, "logprobs");
  bad(json{{"prompt", "a"}, {"echo", "yes"}}, false, "echo");
  bad(json{{"prompt", "a"}, {"max_tokens", 0}}, false, "max_tokens");  // 0 only with echo
  bad(json{{"prompt", "a"}, {"echo", true}, {"stream", true}}, false, "echo");
  const json hi = json::array({{{"role", "user"}, {"content", "Hi"}}});
  bad(json{{"messages", hi}, {"top_logprobs", 2}}, true, "top_logprobs");
  bad(json{{"messages", hi}, {"logprobs", true}, {"top_logprobs", 21}}, true, "top_logprobs");
  bad(json{{"messages", hi}, {"logprobs", 3}}, true, "logprobs");
}

TEST(Server, MetricsParseAsPrometheusTextWithEverySeries) {
  // A prompt of several whole blocks, so that lossy pages are allocated (and kept by the prefix
  // cache) whichever tests ran before.
  const std::string prompt = "Metrics count what the server did: requests, tokens, pages of each class, and the "
                             "meter of every decode step, for operators who watch them over time.";
  ASSERT_EQ(post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}}).status, 200);
  const std::string text = metrics_text();
  const std::string path = ::testing::TempDir() + "/certkv_server_metrics.txt";
  std::ofstream(path) << text;
  // prometheus_client names a counter's family without its _total suffix.
  const std::vector<std::string> families = {
      "certkv:requests_running", "certkv:requests_waiting", "certkv:requests_finished",
      "certkv:prompt_tokens", "certkv:generation_tokens", "certkv:time_to_first_token_seconds",
      "certkv:inter_token_latency_seconds", "certkv:kv_usage_ratio", "certkv:kv_bytes_in_use",
      "certkv:kv_pages_in_use", "certkv:kv_compression_ratio_vs_bf16", "certkv:preemptions",
      "certkv:prefix_cache_hit_tokens", "certkv:prefix_cache_shared_blocks", "certkv:request_meter_max",
      "certkv:request_meter_p99", "certkv:meter_cells", "certkv:meter_cells_within_tau",
      "certkv:meter_coverage", "certkv:gate_repairs", "certkv:http_connections_timed_out"};
  std::string command = "python3 " + testing::source_path("tests/server_metrics_check.py") + " " + path;
  for (const std::string& f : families) command += " " + f;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << out << "\n" << text;
  // Values from the engine: pages in use of the lossy class, a compression above 1.
  EXPECT_GT(metric(text, "certkv:kv_bytes_in_use{class=\"lossy\"}"), 0) << text;
  EXPECT_GT(metric(text, "certkv:kv_compression_ratio_vs_bf16"), 1.0) << text;
  EXPECT_GT(metric(text, "certkv:prompt_tokens_total"), 0);
  EXPECT_GT(metric(text, "certkv:meter_cells_total{scheme=\"fp8-e4m3\"}"), 0) << text;
}

}  // namespace
}  // namespace certkv::server

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  certkv::server::g_env = new certkv::server::ServerEnvironment();
  ::testing::AddGlobalTestEnvironment(certkv::server::g_env);
  return RUN_ALL_TESTS();
}
