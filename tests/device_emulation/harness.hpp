// A command loop that runs a kernel source's entry functions on the emulator (emulator.hpp),
// driven from Python (tests/device_emulation/run.py) over stdin:
//
//   buffer NAME BYTES [FILE]    a zero-filled host buffer, or FILE's bytes
//   launch FUNCTION GX GY GZ BX BY BZ SHARED ARG...    ARG: p:NAME (p:0 null), i:INT, f:FLOAT
//   dump NAME FILE              the buffer's bytes to FILE
//
// Each entry is registered with its signature, so arguments convert to what it takes.
#pragma once

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "emulator.hpp"

namespace emu {

inline std::map<std::string, std::vector<unsigned char>> buffers;

inline void fail(const std::string& message) {
    std::cerr << message << std::endl;
    std::exit(2);
}

template <class T>
T convert(const std::string& argument) {
    const std::string kind = argument.substr(0, 2), value = argument.substr(2);
    if constexpr (std::is_pointer_v<T>) {
        if (kind != "p:") fail("expected a pointer argument, got " + argument);
        if (value == "0") return nullptr;
        auto found = buffers.find(value);
        if (found == buffers.end()) fail("no buffer " + value);
        return reinterpret_cast<T>(found->second.data());
    } else if constexpr (std::is_floating_point_v<T>) {
        if (kind != "f:") fail("expected a float argument, got " + argument);
        return static_cast<T>(std::stod(value));
    } else {
        if (kind != "i:") fail("expected an integer argument, got " + argument);
        return static_cast<T>(std::stoll(value));
    }
}

using Entry = std::function<void(Dim3, Dim3, size_t, const std::vector<std::string>&)>;

template <class... Params>
Entry entry(void (*function)(Params...)) {
    return [function](Dim3 grid, Dim3 threads, size_t shared,
                      const std::vector<std::string>& arguments) {
        if (arguments.size() != sizeof...(Params))
            fail("wrong argument count: " + std::to_string(arguments.size()) + " for " +
                 std::to_string(sizeof...(Params)));
        auto converted = [&]<size_t... I>(std::index_sequence<I...>) {
            return std::tuple<Params...>(convert<Params>(arguments[I])...);
        }(std::index_sequence_for<Params...>{});
        launch(grid, threads, shared, [&] { std::apply(function, converted); });
    };
}

inline int serve(const std::map<std::string, Entry>& entries) {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream words(line);
        std::string command;
        if (!(words >> command)) continue;
        if (command == "buffer") {
            std::string name, file;
            size_t bytes;
            words >> name >> bytes;
            std::vector<unsigned char> data(bytes, 0);
            if (words >> file) {
                std::ifstream in(file, std::ios::binary);
                in.read(reinterpret_cast<char*>(data.data()), bytes);
                if (in.gcount() != static_cast<std::streamsize>(bytes)) fail("short file " + file);
            }
            buffers[name] = std::move(data);
        } else if (command == "launch") {
            std::string name;
            Dim3 grid, threads;
            size_t shared;
            words >> name >> grid.x >> grid.y >> grid.z >> threads.x >> threads.y >> threads.z >>
                shared;
            std::vector<std::string> arguments;
            for (std::string argument; words >> argument;) arguments.push_back(argument);
            auto found = entries.find(name);
            if (found == entries.end()) fail("no entry function " + name);
            found->second(grid, threads, shared, arguments);
        } else if (command == "dump") {
            std::string name, file;
            words >> name >> file;
            auto found = buffers.find(name);
            if (found == buffers.end()) fail("no buffer " + name);
            std::ofstream out(file, std::ios::binary);
            out.write(reinterpret_cast<const char*>(found->second.data()), found->second.size());
        } else {
            fail("unknown command " + command);
        }
    }
    return 0;
}

}  // namespace emu

#define EMULATED_ENTRY(function) \
    { #function, emu::entry(function) }
